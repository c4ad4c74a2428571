"""The grammar worker process, `python -m hylora.structured.worker`, started by structured/sandbox.py.

It probes specs (structured/probe.py) where a native crash or a runaway compile hurts nobody else.
Protocol on stdin / stdout: frames of a 4-byte big-endian length and UTF-8 JSON.

- argv[1]: the server's pid (the worker exits if that is no longer its parent);
- set-up (first frame): {"tokenizer": the HF tokenizer.json text, "vocab_size", "tokenizer_size",
  "eos_ids", "stack_bytes", "memory_bytes"} → {"ok": true} once the llguidance tokenizer is built
  (0.5–3.5 s for a 200k–248k vocabulary, once per worker), else {"ok": false, "error"} and exit;
- each later frame is a spec {"kind", "payload", "whitespace_pattern", "additional_properties"}
  → {"ok": true, "grammar": the text to compile} or {"ok": false, "error": the client's message}.

Bounds: the probes run in a thread whose stack is `stack_bytes` (the server compiles with a stack
several times larger, so whatever passed here cannot overflow there); the address space is
limited (RLIMIT_AS) to what the set-up left plus `memory_bytes`; stdout is moved to stderr so that
nothing native code prints can corrupt a frame; glibc gets two malloc arenas (each reserves
64 MiB of address space); the process dies with its parent (Linux PR_SET_PDEATHSIG) and at the
end of stdin. The time bound is the server's: it kills the process.
A stack overflow or a failed allocation kills the process; the server sees its pipe close.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from typing import Any, BinaryIO

MAX_FRAME = 1 << 30


def write_frame(out: BinaryIO, message: Any) -> None:
    data = json.dumps(message).encode()  # ASCII: an echoed lone surrogate cannot fail here
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    """The next message, or None at the end of the stream."""
    header = _read_exactly(inp, 4)
    if header is None:
        return None
    (size,) = struct.unpack(">I", header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    data = _read_exactly(inp, size)
    if data is None:
        return None
    return json.loads(data)


def _read_exactly(inp: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = inp.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main() -> None:
    _die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    _few_malloc_arenas()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (native code included) go to stderr, not into the frames
    inp = os.fdopen(os.dup(0), "rb")
    setup = read_frame(inp)
    if setup is None:
        return
    try:
        import llguidance

        tokenizer = llguidance.LLTokenizer(
            setup["tokenizer"], n_vocab=int(setup["vocab_size"]), eos_token=[int(e) for e in setup["eos_ids"]]
        )
    except Exception as e:
        write_frame(out, {"ok": False, "error": f"cannot build the tokenizer: {e}"})
        return
    del setup["tokenizer"]
    _limit_memory(int(setup["memory_bytes"]))
    write_frame(out, {"ok": True})
    threading.stack_size(int(setup["stack_bytes"]))
    serve = threading.Thread(
        target=_serve,
        args=(inp, out, tokenizer, int(setup["tokenizer_size"]), [int(e) for e in setup["eos_ids"]]),
        name="hylora-grammar-probe",
    )
    serve.start()
    serve.join()


def _serve(inp: BinaryIO, out: BinaryIO, tokenizer: Any, tokenizer_size: int, eos_ids: list[int]) -> None:
    from hylora.structured.errors import StructuredOutputError
    from hylora.structured.probe import probe_spec
    from hylora.structured.spec import StructuredSpec

    while True:
        request = read_frame(inp)
        if request is None:
            return
        try:
            payload = request["payload"]
            spec = StructuredSpec(
                request["kind"],
                tuple(payload) if isinstance(payload, list) else payload,
                whitespace_pattern=request.get("whitespace_pattern"),
                additional_properties=bool(request.get("additional_properties", True)),
            )
            text, matcher = probe_spec(spec, tokenizer, tokenizer_size, eos_ids)
            del matcher
            reply: dict[str, Any] = {"ok": True, "grammar": text}
        except StructuredOutputError as e:
            reply = {"ok": False, "error": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": "compiling it needs more memory than a grammar may use"}
        except RecursionError:
            reply = {"ok": False, "error": "it is nested too deeply"}
        except Exception as e:  # llguidance raising on odd input: still this spec's problem
            reply = {"ok": False, "error": f"cannot compile it: {e!r}"}
        write_frame(out, reply)


def _limit_memory(extra: int) -> None:
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = vm + extra
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError, StopIteration):
        pass  # not Linux: the time bound still holds


def _die_with_parent(parent: int | None) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:  # the parent died before prctl
            os._exit(0)
    except (OSError, AttributeError):
        pass


def _few_malloc_arenas() -> None:
    """glibc reserves 64 MiB of address space per malloc arena, up to 8 per CPU: on a big host the
    threads' arenas alone would eat the address-space limit. Two are plenty for one probe at a time."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
