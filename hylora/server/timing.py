"""A request's way into the engine, timed by phase (`hylora_request_intake_seconds{phase}`): where a
video request's seconds go before the engine has it.

- read: from the request's headers to its handler (the body received, its JSON parsed and validated);
- prepare: the prompt rendered and tokenised, its media fetched, decoded and preprocessed;
- admit: the engine thread took it (it admits new requests between two steps).

The request's arrival (its headers) is also where its TTFT and E2E histograms start: the latency a
client sees, less the upload of its headers.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram
from starlette.requests import Request

ARRIVAL = "hylora.arrival"  # ASGI scope key: time.monotonic() when the server saw the request's headers


class StampArrival:
    """ASGI middleware, outermost: stamps each HTTP request's arrival in its scope before anything else
    (an API key check, a body limit) runs."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[ARRIVAL] = time.monotonic()
        await self.app(scope, receive, send)


class IntakeClock:
    """One request's intake: `mark(phase)` observes the seconds since the previous mark (the arrival for
    the first) in the histogram under that phase."""

    def __init__(self, request: Request, histogram: Histogram):
        self.arrival: float = request.scope.get(ARRIVAL) or time.monotonic()
        self.phases: dict[str, float] = {}  # phase -> seconds, as marked
        self._last = self.arrival
        self._histogram = histogram

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = now - self._last
        self._histogram.labels(phase=phase).observe(self.phases[phase])
        self._last = now

    def describe(self) -> str:
        """`read 0.53 s, prepare 0.96 s, admit 0.02 s` (for the request's log line)."""
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases.items())
