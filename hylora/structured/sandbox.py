"""The server's side of one grammar worker process (structured/worker.py): start it, probe a spec
through it under a deadline, and absorb its crash.

A ProbeWorker belongs to one compile thread of the GrammarCompiler and is never shared. The
process is started with subprocess (fork + exec of a fresh interpreter, like multiprocessing's
'spawn' but without re-importing the server's `__main__`, and without torch: ~60 ms plus building
the llguidance tokenizer), never by forking the multi-threaded server.

`probe(spec, timeout_s)` returns the grammar text to compile in the server, or raises
StructuredOutputError: the client's error as the worker reported it; CompileTimeout when no
answer came within `timeout_s` (the process is killed: the compile really stops); or, when the
process died (a native stack overflow: SIGSEGV; a failed allocation under its memory limit:
SIGABRT), "too deep or too complex for the grammar compiler". A dead or killed worker is started
again by the next `ensure_started()`, before its thread takes the next spec, so a restart never
counts against anyone's compile time.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hylora.structured.errors import CompileTimeout, StructuredOutputError
from hylora.structured.spec import StructuredSpec
from hylora.structured.worker import MAX_FRAME

log = logging.getLogger(__name__)

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds `hylora`


class WorkerUnavailable(RuntimeError):
    """The worker process could not be started (or set up)."""


class ProbeWorker:
    def __init__(self, setup: dict[str, Any], name: str, start_timeout_s: float = 120.0, max_probes: int = 1000):
        """`setup`: the worker's set-up frame (tokenizer JSON, sizes, EOS ids, stack and memory
        bounds); `max_probes`: probes before a planned restart (bounds memory fragmentation)."""
        self._setup = setup
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.max_probes = max_probes
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None
        self._probes = 0
        self._closed = False
        self.starts = 0  # processes started so far (tests, metrics)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure_started(self) -> None:
        """Start the process unless one is running and fresh; raises WorkerUnavailable."""
        if self._closed:
            raise WorkerUnavailable("the worker was closed")
        if self.alive() and self._probes < self.max_probes:
            return
        self.stop()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (kept open with the process; closed in stop())
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "hylora.structured.worker", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                cwd=str(_PACKAGE_ROOT),  # `-m` imports this checkout's hylora, as the server does
                start_new_session=True,  # a Ctrl-C on the server's terminal is not the worker's
            )
            deadline = time.monotonic() + self.start_timeout_s
            self._send(self._proc, self._setup, deadline)
            reply = self._receive(self._proc, deadline)
        except (OSError, ValueError, TimeoutError, EOFError) as e:
            detail = self._exit_detail()
            self.stop()
            raise WorkerUnavailable(f"{type(e).__name__}: {e}{detail}") from None
        if not reply.get("ok"):
            self.stop()
            raise WorkerUnavailable(str(reply.get("error")))
        self._probes = 0
        self.starts += 1

    def probe(self, spec: StructuredSpec, timeout_s: float) -> str:
        """The grammar text of `spec`, checked in the worker; raises StructuredOutputError."""
        proc = self._proc
        if proc is None:
            raise WorkerUnavailable("the worker is not running")
        request = {
            "kind": spec.kind,
            "payload": list(spec.payload) if spec.kind == "choice" else spec.payload,
            "whitespace_pattern": spec.whitespace_pattern,
            "additional_properties": spec.additional_properties,
        }
        self._probes += 1
        started = time.monotonic()
        try:
            self._send(proc, request, started + timeout_s)
            reply = self._receive(proc, started + timeout_s)
        except TimeoutError:
            log.warning(
                "grammar worker %s: a %s of %d characters ran past %g s; killed",
                self.name, spec.label, _size(spec), timeout_s,
            )  # fmt: skip
            self.stop()
            raise CompileTimeout(f"compiling the {spec.label} took longer than {timeout_s:g} s; simplify it") from None
        except (OSError, EOFError, ValueError):
            if self._closed:
                raise StructuredOutputError("the grammar compiler was shut down") from None
            how = self._exit_detail()
            log.warning(
                "grammar worker %s died on a %s of %d characters%s; it is restarted",
                self.name, spec.label, _size(spec), how,
            )  # fmt: skip
            self.stop()
            raise StructuredOutputError(
                f"the {spec.label} is too deep or too complex for the grammar compiler (compiling it crashed its "
                "worker process); simplify it"
            ) from None
        if reply.get("ok"):
            return str(reply["grammar"])
        raise StructuredOutputError(str(reply.get("error") or f"cannot compile the {spec.label}"))

    def close(self) -> None:
        """Stop for good (a probe in flight fails with "shut down")."""
        self._closed = True
        self.stop()

    def stop(self) -> None:
        """Kill the process (if any) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("grammar worker %s (pid %d) did not exit after SIGKILL", self.name, proc.pid)
            for pipe in (proc.stdin, proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    # --- frames --------------------------------------------------------------------------------
    @staticmethod
    def _send(proc: subprocess.Popen[bytes], message: Any, deadline: float) -> None:
        """Write one frame by the deadline (non-blocking: a worker that stopped reading cannot
        hold the compile thread)."""
        if proc.stdin is None or proc.stdin.closed:
            raise EOFError("the worker's input is closed")
        data = json.dumps(message).encode()  # ASCII: no request text can fail to encode here
        frame = memoryview(struct.pack(">I", len(data)) + data)
        fd = proc.stdin.fileno()
        os.set_blocking(fd, False)
        while frame:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the worker does not read")
            _, ready, _ = select.select([], [fd], [], remaining)
            if not ready:
                continue
            try:
                frame = frame[os.write(fd, frame[: 1 << 16]) :]
            except BlockingIOError:
                continue

    @classmethod
    def _receive(cls, proc: subprocess.Popen[bytes], deadline: float) -> Any:
        header = cls._read(proc, 4, deadline)
        (size,) = struct.unpack(">I", header)
        if size > MAX_FRAME:
            raise ValueError(f"frame of {size} bytes")
        return json.loads(cls._read(proc, size, deadline))

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], size: int, deadline: float) -> bytes:
        if proc.stdout is None or proc.stdout.closed:
            raise EOFError("the worker's output is closed")
        fd = proc.stdout.fileno()
        chunks, left = [], size
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer in time")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError("no answer in time")
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the worker closed its output")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _exit_detail(self) -> str:
        """How the process ended and the end of its stderr, for the log."""
        proc = self._proc
        if proc is None:
            return ""
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return " (still running)"
        if code < 0:
            try:
                how = f" (signal {signal.Signals(-code).name})"
            except ValueError:
                how = f" (signal {-code})"
        else:
            how = f" (exit status {code})"
        if self._stderr is not None:
            try:
                self._stderr.seek(0, os.SEEK_END)
                end = self._stderr.tell()
                self._stderr.seek(max(0, end - 400))
                tail = self._stderr.read().decode(errors="replace").strip()
                if tail:
                    how += ": " + " | ".join(tail.splitlines()[-3:])
            except OSError:
                pass
        return how


def _size(spec: StructuredSpec) -> int:
    return sum(len(c) for c in spec.payload) if spec.kind == "choice" else len(spec.payload)
