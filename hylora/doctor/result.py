"""The outcome of one check: pass / fail / skip, the numbers behind it and the failing cases."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"  # does not apply here (e.g. kernels of a remote server); the reason says why


@dataclass
class CheckResult:
    name: str
    status: Status
    summary: str  # one line, with the numbers
    compared: int = 0  # comparisons made: a check with none cannot pass
    failures: list[str] = field(default_factory=list)  # the failing cases, one line each
    notes: list[str] = field(default_factory=list)  # what it could not check, and how it was computed
    data: dict[str, Any] = field(default_factory=dict)  # the numbers, for --json

    def __post_init__(self) -> None:
        if self.status is Status.PASS and self.compared <= 0:
            raise ValueError(f"check {self.name!r} cannot pass without having compared something")
        if self.status is Status.PASS and self.failures:
            raise ValueError(f"check {self.name!r} cannot pass with failing cases")

    @classmethod
    def judged(cls, name: str, summary: str, compared: int, failures: list[str], **kw: Any) -> CheckResult:
        """PASS when something was compared and nothing failed, else FAIL."""
        if compared <= 0 and not failures:
            failures = ["nothing could be compared"]
        return cls(name, Status.FAIL if failures else Status.PASS, summary, compared, failures, **kw)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "summary": self.summary,
            "compared": self.compared,
            "failures": self.failures,
            "notes": self.notes,
            "data": self.data,
        }
