"""Start the real server as a subprocess on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log_path: Path


@contextmanager
def running_server(args: list[str], cache_dir: Path, log_path: Path, env: dict | None = None, timeout: float = 180):
    """Yields a ServerHandle once /health answers; terminates the server afterwards."""
    port = free_port()
    full_env = os.environ | {"HYLORA_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"} | (env or {})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hylora", "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
            yield ServerHandle(url, proc, log_path)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def metric(url: str, name: str, labels: str = "") -> float:
    """Value of one Prometheus sample, e.g. metric(url, 'hylora_running_requests')."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise KeyError(f"{key} not in /metrics")
