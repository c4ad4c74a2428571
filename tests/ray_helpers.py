"""Helpers for the Ray Serve tests: requests, stream parsing, and finding the replica processes that
a test's own server started (descendants of its process only)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPLICA_LINE = re.compile(r"ServeReplica:[^ ]*HyloraEngine pid=(\d+)\).*replica (\w+) serving")


@dataclass
class Outcome:
    """What a client got: status, text, finish reasons, replica, and any error event."""

    status: int
    text: str = ""
    finish_reasons: list[str | None] = field(default_factory=list)
    replica: str | None = None
    error: dict | None = None
    done: bool = False  # a stream ended with [DONE] (a Responses stream: with its final event)


def chat(url: str, model: str | None, prompt: str, max_tokens: int = 12, stream: bool = False, **extra) -> Outcome:
    body = (
        {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        | ({"model": model} if model is not None else {})
        | extra
    )
    return post(url, "/v1/chat/completions", body)


def post(url: str, path: str, body: dict, timeout: float = 120) -> Outcome:
    if not body.get("stream"):
        r = httpx.post(f"{url}{path}", json=body, timeout=timeout)
        outcome = Outcome(r.status_code, replica=r.headers.get("x-hylora-replica"))
        payload = r.json()
        if r.status_code != 200:
            outcome.error = payload.get("error")
            return outcome
        choice = payload["choices"][0]
        outcome.text = choice["message"]["content"] if "message" in choice else choice["text"]
        outcome.finish_reasons = [c["finish_reason"] for c in payload["choices"]]
        return outcome
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout) as r:
        outcome = Outcome(r.status_code, replica=r.headers.get("x-hylora-replica"))
        if r.status_code != 200:
            outcome.error = json.loads(r.read()).get("error")
            return outcome
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if path == "/v1/responses":
                _response_event(outcome, json.loads(line[len("data: ") :]))
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                outcome.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                outcome.error = event["error"]
                continue
            for c in event["choices"]:
                outcome.text += c.get("delta", {}).get("content", "") if "delta" in c else c.get("text", "")
                if c.get("finish_reason") is not None:
                    outcome.finish_reasons.append(c["finish_reason"])
    return outcome


RESPONSE_ENDS = {"response.completed": "stop", "response.incomplete": "length", "response.failed": "error"}


def _response_event(outcome: Outcome, event: dict) -> None:
    """A Responses stream's event, read as a chat stream's: the final event gives the finish reason."""
    if event["type"] == "response.output_text.delta":
        outcome.text += event["delta"]
    elif event["type"] in RESPONSE_ENDS:
        outcome.finish_reasons.append(RESPONSE_ENDS[event["type"]])
        outcome.error = event["response"].get("error")
        outcome.done = True


def replica_pids(log_path: Path, ancestor: int) -> dict[str, int]:
    """Replica id → pid of the engine replicas this server started (from their start-up log lines),
    only for processes that descend from `ancestor`."""
    found = {tag: int(pid) for pid, tag in REPLICA_LINE.findall(log_path.read_text(errors="replace"))}
    return {tag: pid for tag, pid in found.items() if _descends(pid, ancestor)}


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
    return False
