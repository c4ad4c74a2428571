"""Check 6 (optional), load sanity: N concurrent streams for a bounded time; every request must end
normally with the tokens it asked for, none may be lost or get a server error."""

from __future__ import annotations

from hylora.doctor.deployment import Deployment
from hylora.doctor.result import CheckResult, Status


def check_load(deployment: Deployment, seconds: float, streams: int, max_tokens: int) -> CheckResult:
    if seconds <= 0:
        return CheckResult("load", Status.SKIP, "not requested (--load SECONDS)")
    s = deployment.load(streams, seconds, max_tokens)
    failures = []
    if s.server_errors:
        failures.append(f"{s.server_errors} requests got a server error (5xx or an engine error)")
    if s.other_errors:
        failures.append(f"{s.other_errors} requests were refused (4xx)")
    if s.lost:
        failures.append(f"{s.lost} requests were lost (no finish, no [DONE], or missing tokens)")
    failures += [f"e.g. {e}" for e in s.examples] if failures else []
    summary = (
        f"{s.streams} streams for {s.seconds:g} s: {s.started} requests, {s.completed} completed, {s.tokens} tokens, "
        f"{s.server_errors} server errors, {s.other_errors} refused, {s.lost} lost"
    )
    return CheckResult.judged("load", summary, s.completed if not failures else 0, failures, data=vars(s))
