"""The structured-output exceptions (no heavy imports: the probe worker process uses them too).

StructuredOutputError is the client's fault and answered with HTTP 400; its two subclasses say
why a compile did not finish: CompileTimeout (the spec ran past the compile timeout: also a 400,
cached for a while only) and CompilerBusy (the compile never got a worker within the queue
timeout: the server is overloaded, a 503, never cached).
"""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """The requested output format cannot be served as given (HTTP 400); the message says why."""


class CompileTimeout(StructuredOutputError):
    """Compiling (or probing) the spec took longer than the compile timeout."""


class CompilerBusy(StructuredOutputError):
    """Every grammar worker stayed busy for the whole queue timeout (HTTP 503: retry later)."""
