"""Shutdown as documented (SIGTERM: 503 for new requests, running ones finish or end with an error
event, prompt exit) and bounded cost per client (a client that stops reading is cut, the server's
memory stays bounded)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.server_helpers import metric, running_server

LONG = {
    "messages": [{"role": "user", "content": "Describe the whole site."}],
    "temperature": 0,
    "ignore_eos": True,
}


def _stream_lines(url: str, body: dict, sink: list, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    sink.append(line)
                    started.set()
    except httpx.HTTPError as e:  # the test asserts on what arrived; a broken connection shows as no [DONE]
        sink.append(f"transport error: {e!r}")
    started.set()


def test_sigterm_drains_then_ends_every_stream_and_exits(demo_cache_dir, tmp_path):
    args = ["--demo", "--device", "cpu", "--max-model-len", "4096", "--shutdown-timeout", "2"]
    with running_server(args, demo_cache_dir, tmp_path / "log") as server:
        short_lines: list[str] = []
        long_streams: list[list[str]] = [[], [], []]
        started = [threading.Event() for _ in range(4)]
        threads = [
            threading.Thread(target=_stream_lines, args=(server.url, LONG | {"model": m, "max_tokens": 4000}, s, e))
            for m, s, e in zip(("relic", "tomb", "hylora-demo"), long_streams, started, strict=False)
        ]
        short = LONG | {"model": "mural", "max_tokens": 20}
        threads.append(threading.Thread(target=_stream_lines, args=(server.url, short, short_lines, started[3])))
        plain: dict = {}
        plain_body = LONG | {"model": "relic", "max_tokens": 4000}
        threads.append(
            threading.Thread(
                target=lambda: plain.setdefault(
                    "r", httpx.post(f"{server.url}/v1/chat/completions", json=plain_body, timeout=120)
                )
            )
        )
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=short, timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
        for t in threads:
            t.join(60)
        code = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - signalled
    assert code == 0 and elapsed < 2 + 10, (code, elapsed)

    def finishes(lines):
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        return [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]], events

    reasons, _ = finishes(short_lines)
    assert reasons == ["length"] and short_lines[-1] == "data: [DONE]"  # finished within the grace period
    for lines in long_streams:
        reasons, events = finishes(lines)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert reasons == ["abort"] and events[-1]["error"]["code"] == "shutting_down"
    assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "shutting_down"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_client_that_stops_reading_is_cut_and_memory_stays_bounded(demo_cache_dir, tmp_path):
    args = ["--demo", "--device", "cpu", "--max-model-len", "2048", "--stream-stall-timeout", "2"]
    with running_server(args, demo_cache_dir, tmp_path / "log") as server:
        url = server.url
        probe = {
            "model": "tomb",
            "messages": [{"role": "user", "content": "Where?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        expected = httpx.post(f"{url}/v1/chat/completions", json=probe, timeout=60).json()
        rss_before = _rss_kib(server.proc.pid)
        # 16 choices x 2000 tokens with 20 top logprobs each: ~100 MB of events, far more than the
        # socket buffers hold; the client reads the headers and then nothing.
        body = LONG | {"model": "relic", "max_tokens": 2000, "n": 16, "logprobs": True, "top_logprobs": 20}
        body |= {"stream": True, "temperature": 1.0, "seed": 1}
        payload = json.dumps(body).encode()
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        sock.recv(1024)  # the response has started
        deadline = time.monotonic() + 90
        peak = rss_before
        while time.monotonic() < deadline:
            peak = max(peak, _rss_kib(server.proc.pid))
            if metric(url, "hylora_slow_reader_cuts_total") >= 1 and metric(url, "hylora_running_requests") == 0:
                break
            time.sleep(0.2)
        assert metric(url, "hylora_slow_reader_cuts_total") == 1
        assert metric(url, "hylora_running_requests") == 0 and metric(url, "hylora_kv_pages_used") == 0
        print(f"server RSS grew by {(peak - rss_before) // 1024} MiB while the client stalled")
        assert (peak - rss_before) < 150_000, f"server memory grew by {(peak - rss_before) // 1024} MiB"
        sock.close()
        again = httpx.post(f"{url}/v1/chat/completions", json=probe, timeout=60).json()
        assert again["choices"] == expected["choices"]
