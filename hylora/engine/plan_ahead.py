"""Plan ahead: the step after a step with prompt chunks (or one that admits waiting requests) is
planned and queued on the device before the host reads the step in flight — vLLM's async scheduling
for prefill steps, where decode ahead (engine.py) covers only steps of decode rows.

Why: at 2048 tokens a step a prefill step holds ~40 ms of kernels; read, then schedule, then build and
queue the next step, and the device waits between steps (1.1-3.5 ms) and again at each forward's
start until the host's queue is ahead of it (the 2048-token steps took 43-51 ms on a fast host, run
41). Planned ahead, the host builds and queues step N+1 while the device runs step N.

How: the scheduler plans N+1 on the requests as they will be once N is read, as if each of N's
chunks ran and was finite (`projected`): a request of N has computed its chunk, and one whose chunk
samples has one more token, which only the device holds — a placeholder on the host while the
scheduler plans, and in N+1 a one-token chunk `ahead` whose input the device takes from N's draw.
What reading N changes is caught when N+1 is read, as with decode ahead: a request that stopped,
faulted or was aborted meanwhile has its N+1 rows dropped, and its cache is freed (scrubbed after a
fault) behind N+1 on the device.

Not planned ahead, so the step after N is planned once N is read:
- a request of N that samples and whose next draw needs the host's view of its tokens (grammar,
  penalties, min_tokens: `draws_without_host`), or that asks for prompt logprobs (N appends them);
- speculative decoding (its own verify ahead), or the CPU without `padded_decode` (nothing overlaps
  there; padded_decode is how the tests drive this path);
- a plan that would preempt someone, or runs a suspect (`Scheduler.schedule(preempt=False)`).

A plan whose chunks need media encodes them while it is planned (engine/media_encoding.py), the tower
queued behind the step in flight; the host then waits for the tower's output to check it is finite
before it is cached and used, so such a step overlaps its planning and the tower's launches with the
step in flight, not the host's building of its own forward. A request whose media fail to encode
ends there, as in a step of its own (its rows in the step in flight are dropped when that is read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hylora.engine.request import Request
from hylora.engine.sampler import PendingSample, draws_without_host
from hylora.engine.scheduler import ScheduledChunk

PENDING_TOKEN = -1  # the host's placeholder for a token drawn on the device and not read yet


class AheadLaunchFailed(Exception):
    """Queueing a step planned ahead raised: its requests recompute once the step before is read."""

    def __init__(self, chunks: list[ScheduledChunk], cause: Exception) -> None:
        super().__init__(repr(cause))  # (raised `from` the cause)
        self.chunks = chunks


def drawn_rows(chunks: list[ScheduledChunk], sample: PendingSample | None) -> dict[int, int] | None:
    """id(request) → its row in the step's draw, for the live requests of a step whose chunk samples;
    None when the step after it cannot be planned before it is read."""
    rows = {id(r): i for i, r in enumerate(sample.requests)} if sample is not None else {}
    drawn = {}
    for c in chunks:
        req = c.request
        if req.finished:
            continue
        if c.drafts or req.params.prompt_logprobs is not None:
            return None
        if c.samples:
            if id(req) not in rows or not draws_without_host(req):
                return None
            drawn[id(req)] = rows[id(req)]
    return drawn


def ends_by_length(req: Request, max_model_len: int) -> bool:
    """The token the step in flight draws for `req` is its last (max_tokens or max_model_len)."""
    return len(req.output_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= max_model_len


@contextmanager
def projected(chunks: list[ScheduledChunk], drawn: dict[int, int], max_model_len: int) -> Iterator[None]:
    """The live requests of `chunks` as they will be once the step is read: each chunk computed, and a
    placeholder for each draw that does not end its request (one that ends by length gets no next
    chunk). Restored on exit; chunks made inside keep the projected starts."""
    saved: list[tuple[Request, int, bool]] = []
    try:
        for c in chunks:
            req = c.request
            if req.finished:
                continue
            pending = id(req) in drawn and not ends_by_length(req, max_model_len)
            saved.append((req, req.num_computed, pending))
            req.num_computed = c.start + c.num_tokens
            if pending:
                req.output_ids.append(PENDING_TOKEN)
        yield
    finally:
        for req, num_computed, pending in saved:
            req.num_computed = num_computed
            if pending:
                req.output_ids.pop()


def mark_ahead(plan: list[ScheduledChunk], drawn: dict[int, int]) -> list[int]:
    """Mark the chunks of a projected plan that start at a placeholder (each one token: the draw of the
    step in flight) as `ahead`; their rows in that draw, in order. Call inside `projected`."""
    rows = []
    for c in plan:
        req = c.request
        pending = id(req) in drawn and bool(req.output_ids) and req.output_ids[-1] == PENDING_TOKEN
        if pending and c.start == req.num_tokens - 1:
            c.ahead = True
            rows.append(drawn[id(req)])
    return rows
