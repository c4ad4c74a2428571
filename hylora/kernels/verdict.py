"""What the start-up check decided for one kernel: a record the engine keeps and doctor reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KernelVerdict:
    kernel: str  # "gated_delta_rule", "gdn_decode", "lora", ...
    implementation: str  # what serves: "reference", "triton", "fla", "flash"
    reason: str = ""  # why the reference serves (empty for a fast kernel)
    error: float | None = None  # the start-up check's max relative error vs the reference, when it ran
    tolerance: float | None = None
    check_failed: bool = False  # the fast kernel failed to run or disagreed: the reference serves instead

    @property
    def fast(self) -> bool:
        return self.implementation != "reference"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.fast:
            return f"{self.implementation} (max rel. error {self.error:.1e} vs the reference)"
        return f"reference ({self.reason})" if self.reason else "reference"


def passed(kernel: str, implementation: str, error: float, tolerance: float) -> KernelVerdict:
    return KernelVerdict(kernel, implementation, error=error, tolerance=tolerance)


def reference(kernel: str, reason: str = "", **details: Any) -> KernelVerdict:
    return KernelVerdict(kernel, "reference", reason, **details)


def as_text(verdicts: dict[str, KernelVerdict]) -> dict[str, str]:
    """{kernel: "triton (max rel. error ...)" | "reference (why)"}: for logs and benchmark output."""
    return {name: str(v) for name, v in verdicts.items()}
