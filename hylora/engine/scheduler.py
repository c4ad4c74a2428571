"""Continuous batching: which requests run this step, and how many of their tokens.

FCFS, shared fairly between client requests of many sequences (below). Running requests go first
(decode tokens, or the next chunk of a long prompt), then waiting ones while the per-step token
budget, the running-sequence cap, GDN state slots, KV pages and LoRA slots allow. When a running
request needs a page and none is free, the latest-arrived running request is preempted: its pages
and slot are freed and it recomputes from the start later (its generated tokens are kept). Nothing
crashes for lack of memory: requests queue.

One client request may stand for many sequences (n > 1, a completion's list of prompts: up to 1024
Requests of one `group`). Waiting sequences are ordered by their rank in their group (how many of the
group's sequences were waiting or running when it came) and then by arrival: a one-sequence request
that arrives behind a 1024-sequence one waits for the next free place, not for the other's 1023, and
two large requests take turns. Without groups (LLM.generate's prompts) this is plain FCFS.

A request that was in a step whose forward raised is a suspect (`requeue_suspect`): it goes back to
the head of the queue and its next step runs it alone, so a request that breaks the forward fails
by itself instead of taking its batch down with it.

Adapters: when the request at the head of the queue waits for a LoRA slot (every slot holds the
adapter of some running request), requests behind it whose adapter is already in a slot — or that
use no adapter — start meanwhile, instead of the whole queue waiting behind one cold adapter. This
keeps the distinct adapters per step low. The wait is bounded: once the head has waited
`LORA_WAIT_STEPS` steps, only requests without an adapter may pass it, so the resident adapters'
requests drain, a slot frees and the head starts.

Prefix cache (engine/prefix_cache.py): a request starting fresh resumes from the longest cached
prefix of its prompt, and its prefill chunks end at its snapshot points so that the engine can keep
the state there. Cached pages nobody uses are evicted (LRU) before anyone is preempted.

Media: a prefill chunk may only cover visual tokens whose tower output is ready, cached, or encoded in
this step; encoding is limited to `max_num_encoder_tokens` per step, so a chunk that reaches a
segment (an image, or one temporal patch of a video) the budget cannot pay for stops just before
it and the prefill continues next step — no step stalls to encode a whole long video. A chunk that
encodes part of a video also encodes the video's later temporal patches the budget left can pay for
(`encode_media_ahead`): they reach the request's ready rows and the encoder cache in the same tower
call, so a video is encoded in one or two calls rather than one per step it spans.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from hylora.adapters.files import AdapterError
from hylora.adapters.registry import AdapterRegistry, NoFreeLoRASlot, UnknownAdapter
from hylora.cache import PagedKVCache, StatePool
from hylora.engine.config import EngineConfig
from hylora.engine.encoder_cache import EncoderCache
from hylora.engine.multimodal import Segment
from hylora.engine.prefix_cache import PrefixCache
from hylora.engine.request import FailureKind, Request, Status
from hylora.ops.varlen import RECURRENT_MAX_TOKENS

log = logging.getLogger(__name__)
LORA_WAIT_STEPS = 64  # steps a request waiting for a LoRA slot lets resident adapters' requests pass it
LORA_LOOKAHEAD = 256  # waiting requests looked at past a head that waits for a LoRA slot


class Admission(enum.Enum):
    STARTED = "started"
    FAILED = "failed"  # could not start and never will (adapter gone or broken): in plan.failed
    NO_LORA_SLOT = "no LoRA slot"  # its adapter needs a slot and every slot serves running requests
    NO_ROOM = "no room"  # state slots, KV pages, token or encoder budget


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at token `start`, run this step."""

    request: Request
    start: int
    num_tokens: int
    # segments to take from the cache or encode first (encode_media_ahead: with later ones of the last one's item)
    media: list[Segment] = field(default_factory=list)
    # a decode token planned ahead: its input is the token the step in flight is still sampling
    # (engine.py's decode ahead), so it lies one past the request's tokens known on the host
    ahead: bool = False
    # speculative decoding: draft tokens verified after this decode token (engine/speculative.py);
    # the forward runs num_tokens + len(drafts) positions
    drafts: list[int] = field(default_factory=list)
    # this chunk reaches the end of the request's tokens: a next token is sampled from it
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.ahead or self.start + self.num_tokens == self.request.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # could not start (adapter gone or broken); error set
    # planned with preempt=False, a running request found no free KV page: the plan is not to be run
    blocked: bool = False


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: PagedKVCache,
        states: StatePool,
        adapters: AdapterRegistry | None,
        encoder_cache: EncoderCache | None = None,
        media_key: Callable[[Request, Segment], Hashable] | None = None,
        prefix: PrefixCache | None = None,
    ):
        self.config = config
        self.prefix = prefix
        self.kv, self.states, self.adapters = kv, states, adapters
        self.encoder_cache, self.media_key = encoder_cache, media_key
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._group_size: dict[str, int] = {}  # group → its sequences waiting or running
        # state slots each running request holds: its own, and one per draft it may verify
        self.slots_per_request = 1 + config.num_speculative_tokens
        self.num_preemptions = 0  # cumulative (metrics)
        self._encoder_budget = 0  # encoder tokens left in the step being planned
        self._step_media: set[Hashable] = set()  # media keys the step being planned encodes already

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        """Queue `req` behind every waiting request of its rank or lower (see the module's docstring)."""
        if req.group is not None:
            req.queue_rank = self._group_size.get(req.group, 0)
            self._group_size[req.group] = req.queue_rank + 1
        behind = len(self.waiting)
        while behind > 0 and self.waiting[behind - 1].queue_rank > req.queue_rank:
            behind -= 1
        self.waiting.insert(behind, req)

    def can_admit(self) -> bool:
        """A request waits and the next schedule may start it (a running place and a state slot are
        free); False: the next step can only continue the running requests."""
        return (
            bool(self.waiting)
            and len(self.running) < self.config.max_num_seqs
            and self.states.num_free >= self.slots_per_request
        )

    def schedule(self, preempt: bool = True, step: int | None = None) -> StepPlan:
        """The next step's chunks. `preempt` False (a step planned while the one before it is still on
        the device, engine/plan_ahead.py): nobody is preempted, and a running request that finds no
        free page marks the plan `blocked` instead; no suspect is planned. `step`: the engine step
        planned, so that a plan made ahead and dropped, then made again, counts one LoRA wait."""
        plan = StepPlan()
        self._encoder_budget = self.config.max_num_encoder_tokens
        self._step_media = set()
        suspect = self.waiting[0] if self.waiting and self.waiting[0].suspect_count else None
        room = len(self.running) < self.config.max_num_seqs
        if suspect is not None and not preempt:
            plan.blocked = True  # a suspect runs alone, planned once every step before it is read
            return plan
        if suspect is not None and room and self._admit(suspect, plan) in (Admission.STARTED, Admission.FAILED):
            return plan  # a suspect runs alone
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, media = self._fit_media(req, self._cut(req, min(req.num_uncomputed, budget)))
            if n == 0:  # its next visual tokens wait for encoder budget
                i += 1
                continue
            drafts, req.draft_ids = (req.draft_ids[: budget - n] if req.num_uncomputed == n == 1 else []), []
            if drafts and not self.ensure_pages(req, req.num_computed + n + len(drafts)):
                drafts = []  # no one is preempted for drafts
            while not self.ensure_pages(req, req.num_computed + n):
                if not preempt:
                    plan.blocked = True
                    return plan
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            plan.chunks.append(ScheduledChunk(req, req.num_computed, n, media, drafts=drafts))
            self._spend(req, media)
            budget -= n + len(drafts)
            i += 1

        while self.waiting and budget > 0 and not plan.preempted and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            if head.suspect_count:
                break
            admission = self._admit(head, plan, budget)
            if admission is Admission.STARTED:
                budget -= plan.chunks[-1].num_tokens
            elif admission is Admission.NO_LORA_SLOT:
                if step is None or head.lora_waited_at != step:
                    head.lora_wait_steps += 1
                    head.lora_waited_at = step
                self._admit_past(head, plan, budget)
                break
            elif admission is Admission.NO_ROOM:
                break
        if any(c.num_tokens > RECURRENT_MAX_TOKENS for c in plan.chunks):
            for c in plan.chunks:  # verify chunks need the token-by-token GDN kernel (engine/speculative.py)
                c.drafts = []
        return plan

    def _admit_past(self, head: Request, plan: StepPlan, budget: int) -> None:
        """The head waits for a LoRA slot: start the requests behind it that need none (their adapter
        is resident, or they have none), in order, while there is room — only adapter-free ones once
        the head has waited LORA_WAIT_STEPS steps."""
        overdue = head.lora_wait_steps > LORA_WAIT_STEPS
        for req in list(itertools.islice(self.waiting, 1, LORA_LOOKAHEAD)):  # a copy: _admit removes
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.suspect_count or (req.adapter is not None and (overdue or not self._resident(req))):
                continue
            admission = self._admit(req, plan, budget)
            if admission is Admission.STARTED:
                budget -= plan.chunks[-1].num_tokens
            elif admission is Admission.NO_ROOM:
                return

    def _resident(self, req: Request) -> bool:
        """Its adapter can start without a free slot: already in one, or the request holds a lease."""
        if req.lora is not None:
            return True
        if self.adapters is None or req.adapter is None:
            return False
        try:
            version = req.prepared.version if req.prepared is not None else self.adapters.get(req.adapter)
        except Exception:  # unloaded meanwhile: _admit reports it when the request reaches the head
            return False
        return version.slot is not None and not version.unloaded

    def _admit(self, req: Request, plan: StepPlan, budget: int | None = None) -> Admission:
        """Start the waiting request `req` if its adapter, a state slot and its first pages are
        available. A request that can never start (adapter gone) goes to plan.failed (FAILED) so the
        queue moves on."""
        budget = self.config.max_num_batched_tokens if budget is None else budget
        if req.adapter is not None and req.lora is None:
            try:
                req.lora = self.adapters.acquire(req.prepared or req.adapter)  # type: ignore[union-attr]
            except NoFreeLoRASlot:
                return Admission.NO_LORA_SLOT  # every LoRA slot serves running requests
            except Exception as e:  # unloaded while waiting, files broken, or a bug placing it
                self.waiting.remove(req)
                req.error, req.failure = _adapter_failure(e)
                plan.failed.append(req)
                return Admission.FAILED
        if req.state_slot is None:
            if self.states.num_free < self.slots_per_request:
                return Admission.NO_ROOM
            req.state_slot = self.states.allocate()
            req.spec_slots = [self.states.allocate() for _ in range(self.slots_per_request - 1)]
            if self.prefix is not None:
                self.prefix.attach(req)
                req.cache_points = self.prefix.snapshot_points(req)
        n, media = self._fit_media(req, self._cut(req, min(req.num_uncomputed, budget)))
        if n == 0 or not self.ensure_pages(req, req.num_computed + n):
            return Admission.NO_ROOM
        self.waiting.remove(req)
        req.status = Status.RUNNING
        req.scheduled_time = req.scheduled_time or time.monotonic()
        self.running.append(req)
        plan.chunks.append(ScheduledChunk(req, req.num_computed, n, media))
        self._spend(req, media)
        return Admission.STARTED

    def _cut(self, req: Request, n: int) -> int:
        """`n` tokens from req.num_computed, or fewer: a chunk ends at the next snapshot point."""
        start = req.num_computed
        for point in req.cache_points:
            if start < point < start + n:
                return point - start
        return n

    def _fit_media(self, req: Request, n: int) -> tuple[int, list[Segment]]:
        """How many of the next `n` tokens can run this step, and the segments they need that the
        request does not hold yet. A chunk stops before the first segment the encoder budget left in
        this step cannot pay for (a cached segment costs nothing)."""
        mm, start = req.mm, req.num_computed
        if mm is None or start >= mm.positions.prompt_len:
            return n, []
        needed, cost = [], 0
        for seg in mm.segments_in(start, start + n):
            if seg.id in mm.ready:
                continue
            price = self._encoder_cost(req, seg)
            if cost + price > self._encoder_budget:
                return max(0, seg.start - start), needed
            needed.append(seg)
            cost += price
        if needed and self.config.encode_media_ahead:
            needed += self._ahead(req, needed[-1], start + n, self._encoder_budget - cost)
        return n, needed

    def _ahead(self, req: Request, last: Segment, end: int, budget: int) -> list[Segment]:
        """The segments of `last`'s item after the chunk (which ends before `end`) that the request does
        not hold, in order, while `budget` pays for them: encoded in the same tower call as the chunk's."""
        mm = req.mm
        assert mm is not None
        ahead = []
        for seg in mm.segments:
            if seg.item != last.item or seg.start < end or seg.id in mm.ready:
                continue
            price = self._encoder_cost(req, seg)
            if price == 0:  # cached, or another chunk of this step encodes it
                continue
            if price > budget:
                break
            ahead.append(seg)
            budget -= price
        return ahead

    def _encoder_cost(self, req: Request, seg: Segment) -> int:
        """Nothing for a segment the encoder cache holds or this step encodes for another chunk
        (MediaEncoder encodes each once)."""
        if self.encoder_cache is None or self.media_key is None:
            return seg.num_tokens
        key = self.media_key(req, seg)
        return 0 if key in self.encoder_cache or key in self._step_media else seg.num_tokens

    def _spend(self, req: Request, media: list[Segment]) -> None:
        self._encoder_budget -= sum(self._encoder_cost(req, seg) for seg in media)
        if self.media_key is not None:
            self._step_media.update(self.media_key(req, seg) for seg in media)

    def requeue_suspect(self, req: Request) -> None:
        """`req` was in a step whose forward raised: scrub what it wrote, and queue it to recompute
        alone at the head of the queue."""
        self._preempt(req, scrub=True)
        req.suspect_count += 1

    def finish(self, req: Request, scrub: bool = False) -> None:
        """Take `req` out of the queues and free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_cache(req, scrub)
        if req.lora is not None and self.adapters is not None:
            self.adapters.release(req.lora)
            req.lora = None
        if req.group is not None and req.status is not Status.FINISHED:
            left = self._group_size.pop(req.group, 1) - 1
            if left > 0:
                self._group_size[req.group] = left
        req.status = Status.FINISHED

    def ensure_pages(self, req: Request, num_tokens: int) -> bool:
        need = self.kv.pages_needed(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if need > self.kv.num_free and (self.prefix is None or not self.prefix.free_pages(need)):
            return False
        req.pages += self.kv.allocate(need)
        return True

    def _preempt(self, req: Request, scrub: bool = False) -> None:
        log.info("preempting %s; it will recompute %d tokens", req.request_id, req.num_tokens)
        if req in self.running:
            self.running.remove(req)
        self._free_cache(req, scrub=scrub)
        req.num_computed = 0
        req.draft_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        req.queue_rank = -1  # back at the head: no newcomer is queued in front of it
        self.waiting.appendleft(req)

    def _free_cache(self, req: Request, scrub: bool) -> None:
        if scrub:  # a faulted request may have written NaN: clear before anyone can be handed them
            if self.prefix is not None:  # no cached prefix keeps a page it may have written
                self.prefix.forget_pages(req.pages)
            self.kv.scrub([p for p in req.pages if not self.kv.shared(p)])
            if req.state_slot is not None:
                self.states.reset(req.state_slot)
        self.kv.free(req.pages)
        req.pages = []
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        for slot in req.spec_slots:
            self.states.free(slot)
        req.spec_slots = []


def _adapter_failure(e: Exception) -> tuple[str, FailureKind]:
    if isinstance(e, UnknownAdapter):
        return str(e), FailureKind.ADAPTER_NOT_FOUND
    if isinstance(e, AdapterError):
        return str(e), FailureKind.ADAPTER_BROKEN
    log.exception("placing an adapter failed")
    return f"internal error while placing the adapter: {e!r}", FailureKind.INTERNAL
