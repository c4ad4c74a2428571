"""A watch around hostile requests: neighbours that must finish unchanged, /health that must keep
answering, and a fresh text request that must not wait on the offender.

    with Watch(url, baseline) as w:
        ...send offenders, assert their 4xx...
    # on exit: neighbours equal the baseline, /health answered within 1 s throughout, and a fresh
    # 4-token text request sent during the attack took at most 1 s more than it takes without one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

HEALTH_LIMIT_S = 1.0
FRESH_DELAY_LIMIT_S = 1.0


def neighbour_bodies(image_url: str, tokens: int) -> dict[str, dict]:
    """A streaming request on an adapter (text) and a non-streaming one on another adapter with an image."""
    greedy = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    text = {"model": "relic", "messages": [{"role": "user", "content": "Describe the relic in the north chamber."}]}
    image = {
        "model": "tomb",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Where?"}],
            }
        ],
    }
    return {"stream": text | greedy | {"stream": True}, "image": image | greedy}


def fresh_text(url: str) -> float:
    """Seconds a short greedy text request takes from send to answer."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


class Neighbours:
    """Requests running in threads while a test sends its offenders; a body with "stream" streams.
    `result[name]` is each one's (text, finish_reason); `errors` any error it met."""

    def __init__(self, url: str, bodies: dict[str, dict]):
        self.url, self.bodies = url, bodies
        self.result: dict[str, tuple[str, str | None]] = {}
        self.errors: list[str] = []
        self.started = threading.Event()
        if not any(b.get("stream") for b in bodies.values()):
            self.started.set()
        self.threads = [threading.Thread(target=self._run, args=item) for item in bodies.items()]

    def start(self) -> None:
        for t in self.threads:
            t.start()
        assert self.started.wait(60), "the streaming neighbour never started"

    def join(self) -> None:
        for t in self.threads:
            t.join(180)

    def __enter__(self) -> Neighbours:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.join()

    def _run(self, name: str, body: dict) -> None:
        (self._stream if body.get("stream") else self._plain)(name, body)

    def _stream(self, name: str, body: dict) -> None:
        text, finish = [], None
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=180) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    self.started.set()
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(line)
                    for choice in event.get("choices", []):
                        text.append(choice["delta"].get("content") or "")
                        finish = choice["finish_reason"] or finish
        finally:
            self.started.set()
            self.result[name] = ("".join(text), finish)

    def _plain(self, name: str, body: dict) -> None:
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=180)
        if r.status_code != 200:
            self.errors.append(r.text)
            return
        choice = r.json()["choices"][0]
        self.result[name] = (choice["message"]["content"], choice["finish_reason"])


def run_neighbours(url: str, bodies: dict[str, dict]) -> tuple[dict[str, tuple[str, str | None]], float]:
    """The neighbours' outputs and a fresh text request's time, with no offender about."""
    n = Neighbours(url, bodies)
    n.start()
    quiet = fresh_text(url)
    n.join()
    assert not n.errors, n.errors
    return n.result, quiet


class Watch:
    """Neighbours + a /health poller + a fresh text request during the attack; checked on exit."""

    def __init__(self, url: str, bodies: dict[str, dict], baseline: dict, quiet_s: float, settle_s: float = 0.3):
        self.url, self.bodies, self.baseline, self.quiet_s, self.settle_s = url, bodies, baseline, quiet_s, settle_s
        self.health: list[float] = []
        self.fresh: list[float] = []
        self._stop = threading.Event()

    def __enter__(self) -> Watch:
        self.neighbours = Neighbours(self.url, self.bodies)
        self.neighbours.start()
        self._poller = threading.Thread(target=self._poll)
        self._poller.start()
        return self

    def attack(self, *offenders, settle_s: float = 0.5) -> list:
        """Run each offender (a callable returning its response) in its own thread; once they are in
        flight, time a fresh text request. Returns the offenders' results in order."""
        results: list = [None] * len(offenders)

        def run(i: int, fn) -> None:
            try:
                results[i] = fn()
            except BaseException as e:  # noqa: BLE001 - surfaced to the test below
                results[i] = e

        threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(offenders)]
        for t in threads:
            t.start()
        time.sleep(settle_s)
        self.during()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "an offender never got its answer"
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def during(self) -> None:
        """Send the fresh text request now (call while the offenders are in flight)."""
        self.fresh.append(fresh_text(self.url))

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                ok = httpx.get(f"{self.url}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.health.append(time.monotonic() - start if ok else float("inf"))
            self._stop.wait(0.2)

    def __exit__(self, *exc) -> None:
        if not self.fresh and exc[0] is None:
            self.during()
        self.neighbours.join()
        self._stop.set()
        self._poller.join()
        if exc[0] is not None:
            return
        assert not self.neighbours.errors, self.neighbours.errors
        assert self.neighbours.result == self.baseline, "a neighbour's output changed"
        assert max(self.health) < HEALTH_LIMIT_S, f"/health took {max(self.health):.2f} s"
        slowest = max(self.fresh)
        assert slowest <= self.quiet_s + FRESH_DELAY_LIMIT_S, f"a fresh text request took {slowest:.2f} s"
        assert httpx.get(f"{self.url}/health", timeout=5).status_code == 200


def slowest_health_during(url: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s result and the slowest /health answer while it ran (polled every 50 ms)."""
    times: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                start = time.monotonic()
                client.get(f"{url}/health")
                times.append(time.monotonic() - start)
                stop.wait(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = fn()
    finally:
        stop.set()
        poller.join()
    return result, max(times)


def assert_error(r: httpx.Response, status: int, *needles: str, within: float | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["message"] and error["type"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    if within is not None:
        assert r.elapsed.total_seconds() < within, r.elapsed
    return error
