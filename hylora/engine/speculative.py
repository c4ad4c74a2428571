"""Speculative decoding with the checkpoint's MTP layer (`--speculative-config '{"method": "mtp", ...}'`).

A step with speculation, for a request that speculates:

1. verify: its decode token and the k drafts the MTP layer made run as one chunk of k+1 positions
   (the row's adapter applies as in any step). The GDN layers keep the state after every position
   in the request's spare state slots (`Request.spec_slots`, ops `spec_slots`).
2. accept (`launch_verify`): greedy rows keep drafts while they equal the target's argmax; sampled
   rows accept draft d with probability p(d) and, at the first rejection, draw from p with d removed
   (the draft is one token, so this is the standard rejection rule with a one-hot draft
   distribution): the output distribution is the target's. The first rejected position (or the
   position after the last draft) gives one more token, so a step yields 1 to k+1 tokens.
3. commit (`commit_state`): the spare slot holding the GDN and conv state after the last accepted
   position becomes the request's slot (the two trade places, nothing is copied); attention KV of
   rejected positions is simply overwritten later.
4. draft (`Drafter.propose`): the MTP layer runs over the positions this step computed (row t: the
   decoder's hidden state at t with the token at t+1), filling its own KV cache and giving the
   first draft; k-1 more single-row passes feed it its own output and the draft before, the
   drafts staying on the device until one copy brings all of them to the host. A step of verify
   chunks queues this behind its acceptance instead (`Drafter.launch`), before the host reads it,
   and with decode ahead the next verify step is queued too (engine.py `_verify_ahead`).

Structured outputs speculate: a grammar cuts the drafts it cannot take (`GrammarMatcher.draft_prefix`)
and masks each verified row with its state after the drafts before it (`grammar_masks`).
What does not speculate (it decodes one token per step, in the same steps): a request with
penalties or unmet min_tokens (each draft's logits would depend on the drafts before it through
counts the host keeps), steps that also carry a prefill chunk longer than the token-by-token
GDN kernel takes (`RECURRENT_MAX_TOKENS`), and drafts that would pass max_tokens or max_model_len.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.draft_step import DraftJob, PaddedDraft
from hylora.engine.host_copy import HostCopy
from hylora.engine.request import Request, TokenLogprob
from hylora.engine.sampler import (
    SamplingError,
    _edit_row,
    _generator,
    _logprob_tensors,
    _logprobs_from_host,
    counts_tokens,
    filtered_probs,
    to_device,
)
from hylora.engine.scheduler import ScheduledChunk
from hylora.engine.short_step import VerifyAhead
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk
from hylora.ops.host_to_device import host_to_device
from hylora.structured.mask import allocate_bitmask, apply_bitmask

METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")  # vLLM's `method`s for MTP; the last two its older names


def check_speculative_config(config: Any) -> dict[str, Any] | None:
    """vLLM's --speculative-config JSON (already parsed), checked: the config with
    num_speculative_tokens filled in, or None. Raises ValueError saying what to change."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config expects a JSON object")
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)}")
    k = config.get("num_speculative_tokens", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 4:
        raise ValueError("--speculative-config: num_speculative_tokens must be an integer in [1, 4]")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens", "model", "draft_sample_method"})
    if unknown:
        raise ValueError(f"--speculative-config: hylora does not take {', '.join(unknown)} (it takes method, "
                         "num_speculative_tokens, and model / draft_sample_method at vLLM's defaults)")  # fmt: skip
    if config.get("draft_sample_method", "greedy") != "greedy":
        raise ValueError("--speculative-config: draft_sample_method must be 'greedy' (the MTP layer drafts by argmax)")
    return {**config, "num_speculative_tokens": k}


@dataclass
class SpecStats:
    """Cumulative counters (vLLM's spec_decode metrics)."""

    drafts: int = 0  # verify chunks run
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: draft i accepted


# --- accept ------------------------------------------------------------------------------------
class PendingVerify:
    """The acceptance of a step's verify chunks, queued on the device; `results()` waits once."""

    def __init__(
        self,
        requests: list[Request],
        sizes: list[int],  # rows per request: drafts + 1
        candidates: torch.Tensor,  # [R] token each row gives if the walk reaches it
        accept: torch.Tensor,  # [R] the row's draft is accepted
        code: torch.Tensor,  # [R] 0: fine; 1: the row cannot be sampled
        logprobs: tuple[list[int], list[int], tuple[torch.Tensor, ...]] | None,
    ) -> None:
        self.requests, self.sizes, self._logprobs = requests, sizes, logprobs
        device = candidates.device
        self.candidates = candidates  # [R] on the device (drafting queued behind this step reads it)
        owner = to_device([i for i, n in enumerate(sizes) for _ in range(n)], device, torch.long)  # [R]
        self.firsts = to_device([0, *itertools.accumulate(sizes)][:-1], device, torch.long)  # each one's first row
        self.accepted = _leading_accepted(accept, owner, self.firsts)  # [len(requests)] on the device
        self._host = HostCopy(torch.stack([candidates, accept.long(), code]), *(logprobs[2] if logprobs else ()))

    def new_tokens(self) -> torch.Tensor:
        """[len(requests)] on the device: each request's token after its accepted drafts."""
        return self.candidates[self.firsts + self.accepted]

    def results(self) -> list[list[tuple[int, TokenLogprob | None]] | SamplingError]:
        """Per request: the tokens this step gives (accepted drafts, then one more), each with its
        logprob info when asked; or the SamplingError that ends the request."""
        (candidates, accept, code), *lp_host = self._host.values()
        infos: dict[int, TokenLogprob] = {}
        if self._logprobs is not None:
            wants, ks, _ = self._logprobs
            tokens = [candidates[r] for r in wants]
            infos = dict(zip(wants, _logprobs_from_host(*lp_host, tokens, ks), strict=True))
        out: list[list[tuple[int, TokenLogprob | None]] | SamplingError] = []
        row = 0
        for n in self.sizes:
            rows = range(row, row + n)
            row += n
            taken = []
            for r in rows:
                if code[r]:
                    taken = SamplingError(
                        "no token has a finite, positive probability after temperature, top_k / top_p / "
                        "min_p and logit_bias; relax them"
                    )
                    break
                taken.append((candidates[r], infos.get(r)))
                if not accept[r]:
                    break
            out.append(taken)
        return out


def _leading_accepted(accept: torch.Tensor, owner: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
    """Per request (the rows `owner` [R] gives it, consecutive from `firsts` [n]), how many of its rows
    from the first are accepted: its accepted drafts (each request's last row is never accepted)."""
    rejected = (~accept).long().cumsum(0)  # [R] rejections up to and including each row
    before = rejected[firsts] - (~accept[firsts]).long()  # rejections before each request's first row
    leading = rejected == before[owner]  # no rejection in the request up to this row
    return torch.zeros(firsts.shape, dtype=torch.long, device=accept.device).index_add_(0, owner, leading.long())


def launch_verify(
    logits: list[torch.Tensor],  # per request [k_i + 1, V] fp32: its decode token's row, then each draft's
    requests: list[Request],
    drafts: list[list[int]],
    eos_ids: tuple[int, ...] = (),
    device_drafts: torch.Tensor | None = None,
) -> PendingVerify:
    """Accept each request's drafts against its logits (module docstring, step 2), on the device.
    `device_drafts` [R]: the drafts on the device, laid out as the rows (-1 after each request's last;
    a step planned ahead, whose `drafts` the host has not read: only their number counts)."""
    sizes = [len(d) + 1 for d in drafts]
    owner = [i for i, n in enumerate(sizes) for _ in range(n)]
    rows = torch.cat(logits)  # [R, V]
    R, vocab = rows.shape
    device = rows.device
    draft = device_drafts  # -1: the row after the drafts
    if draft is None:
        draft = to_device([t for d in drafts for t in (*d, -1)], device, torch.long)
    work = rows.clone()
    for r, i in enumerate(owner):  # logit_bias (speculating requests have no penalties or min_tokens)
        _edit_row(work[r], requests[i], eos_ids, vocab)
    code = (~torch.isfinite(work).any(-1)).long()
    candidates = work.argmax(-1)
    accept = candidates == draft
    sampled = [r for r, i in enumerate(owner) if not requests[i].params.greedy]
    if sampled:
        params = [requests[owner[r]].params for r in sampled]
        idx = to_device(sampled, device, torch.long)
        temperature = to_device([p.temperature for p in params], device)
        probs = filtered_probs(
            work[idx] / temperature[:, None], [p.top_k for p in params], [p.top_p for p in params],
            [p.min_p for p in params],
        )  # fmt: skip
        probs = torch.nan_to_num(probs, nan=0.0)
        good = probs.sum(-1) > 0
        has_draft = draft[idx] >= 0
        d = draft[idx].clamp(min=0)
        p_draft = probs.gather(1, d[:, None])[:, 0] * has_draft
        uniform, race = torch.empty(len(sampled), device=device), torch.empty_like(probs)
        for j, r in enumerate(sampled):  # each request's own generator: a seed reproduces its tokens
            g = _generator(requests[owner[r]], device)
            uniform[j : j + 1].uniform_(generator=g)
            race[j].exponential_(generator=g)
        took = uniform < p_draft
        # the rejected draft's mass removed (rows after the drafts keep all of p)
        residual = probs.scatter(1, d[:, None], torch.where(has_draft, 0.0, p_draft)[:, None].to(probs.dtype))
        residual = torch.where((residual.sum(-1) > 0)[:, None], residual, probs)
        drawn = (residual / race.clamp_(min=1e-30)).argmax(-1)
        candidates[idx] = torch.where(took, d, drawn)
        accept[idx] = took
        code[idx] = torch.where(good, code[idx], 1)
    wants = [r for r, i in enumerate(owner) if requests[i].params.logprobs is not None]
    logprob_info = None
    if wants:
        ks = [requests[owner[r]].params.logprobs or 0 for r in wants]
        raw = torch.log_softmax(rows[to_device(wants, device, torch.long)], dim=-1)
        logprob_info = (wants, ks, _logprob_tensors(raw, candidates[to_device(wants, device, torch.long)], max(ks)))
    return PendingVerify(requests, sizes, candidates, accept, code, logprob_info)


def commit_state(req: Request, accepted: int, num_drafts: int) -> None:
    """After `accepted` of `num_drafts` drafts: the state after position `accepted` of the verify
    chunk becomes the request's (the chunk's last position's is already in its slot). The two slots
    trade places, so nothing is copied (every GDN layer's state of one request: 151 MB on the 27B
    shape); the slot that held the rejected positions' state becomes a spare one."""
    if accepted < num_drafts:
        assert req.state_slot is not None
        req.state_slot, req.spec_slots[accepted] = req.spec_slots[accepted], req.state_slot


def grammar_masks(
    requests: list[Request], drafts: list[list[int]], logits: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[Exception | None]]:
    """Each structured-output request's verify rows masked (row j: the grammar's mask after its
    drafts[:j]; a masked copy, the others as they are), and each request's grammar error or None."""
    masked: list[torch.Tensor] = []
    errors: list[Exception | None] = []
    for req, d, rows in zip(requests, drafts, logits, strict=True):
        masked.append(rows)
        errors.append(None)
        if req.grammar is None:
            continue
        try:
            bitmask = allocate_bitmask(len(d) + 1, rows.shape[1])
            req.grammar.fill_draft_masks(bitmask, d)
            masked[-1] = rows.clone()
            apply_bitmask(masked[-1], bitmask, range(len(d) + 1))
        except Exception as e:
            errors[-1] = e
    return masked, errors


def _grammar_prefix(req: Request, drafts: list[int]) -> list[int]:
    """The drafts a structured-output request's grammar can take (all of them without a grammar)."""
    if req.grammar is None or not drafts:
        return drafts
    try:
        return req.grammar.draft_prefix(drafts)
    except Exception:  # the mask step reports a broken grammar; here it only costs the drafts
        return []


# --- draft -------------------------------------------------------------------------------------
def _column(tokens: list[list[int]], finite: list[list[bool]], i: int, wanted: int) -> list[int]:
    """Request i's drafts from the passes' host rows: up to `wanted`, ending before its first
    non-finite one (its output is unaffected)."""
    drafts = []
    for step in range(min(wanted, len(tokens))):
        if not finite[step][i]:
            break
        drafts.append(int(tokens[step][i]))
    return drafts


class PendingDrafts:
    """Drafts queued behind a verify step (`Drafter.launch`); `collect` waits for them once."""

    def __init__(self, drafter: Drafter, requests: list[Request], tokens: torch.Tensor, finite: torch.Tensor) -> None:
        self.drafter, self.requests = drafter, requests
        self.tokens = tokens  # [k, len(requests)] on the device (a verify step planned ahead reads them there)
        self._host = HostCopy(tokens, finite)

    def collect(self, num_drafts: Callable[[Request], int]) -> None:
        """Once the step's tokens are appended: each live request's drafts, as many as
        `num_drafts(req)` allows now."""
        tokens, finite = self._host.values()
        for i, req in enumerate(self.requests):
            req.draft_ids = []
            if not req.finished:
                self.drafter.assign(req, _column(tokens, finite, i, num_drafts(req)))


class Drafter:
    """Runs the MTP layer after each step and leaves each speculating request's drafts in
    `Request.draft_ids` (module docstring, step 4). With `padded` (engine/draft_step.py) a step that
    fits runs as one padded drafting step (a CUDA graph on the GPU); else pass by pass, eagerly."""

    def __init__(
        self,
        model: HybridDecoder,
        kv: PagedKVCache,
        states: StatePool,
        num_tokens: int,
        padded: PaddedDraft | None = None,
        max_model_len: int = 0,
        reserve: Callable[[Request, int], bool] = lambda req, num_tokens: False,
    ) -> None:
        """`reserve(req, num_tokens)` gives `req` KV pages for that many tokens if it can (the
        scheduler's); with `max_model_len`, what `launch` needs to queue drafting ahead."""
        if model.mtp is None:
            raise ValueError("speculative decoding needs the model's MTP layer (load_model(..., mtp=True))")
        self.model, self.kv, self.states, self.k = model, kv, states, num_tokens
        self.padded, self.max_model_len, self.reserve = padded, max_model_len, reserve

    def budget(self, req: Request, max_model_len: int) -> int:
        """How many drafts the request's next step may verify."""
        if req.finished or counts_tokens(req):
            return 0
        left = req.params.max_tokens - len(req.output_ids) - 1  # the step also gives one token of its own
        return max(0, min(self.k, left, max_model_len - req.num_tokens - 1))

    @torch.inference_mode()
    def propose(
        self,
        ran: list[tuple[ScheduledChunk, torch.Tensor]],  # chunks read this step, with their hidden rows
        num_drafts: Callable[[Request], int],  # drafts wanted (0: only keep the MTP cache up to date)
    ) -> None:
        """The MTP layer over the positions each request computed this step, then its drafts."""
        reqs, jobs = [], []
        for c, rows in ran:
            req = c.request
            req.draft_ids = []
            n = req.num_computed - c.start  # positions computed this step (a verify chunk: 1 + accepted)
            if req.finished or n <= 0 or len(req.all_ids) < c.start + n + 1:
                continue
            k = num_drafts(req)
            first = self._chunk(req, req.all_ids[c.start + 1 : c.start + n + 1], c.start)
            later = [self._chunk(req, [0], req.num_tokens - 2 + step) for step in range(1, k)]
            reqs.append(req)
            jobs.append(DraftJob(first, rows[:n], later, k))
        if not jobs:
            return
        live = [i for i, job in enumerate(jobs) if job.drafts > 0]
        if self.padded is not None and self.padded.fits(jobs):
            tokens, finite = self.padded.run(jobs)  # [K, len(jobs)]
        else:
            tokens, finite = self._eager(jobs)
        if not live:
            return
        host_tokens, host_finite = HostCopy(tokens, finite).values()  # the one wait for the host
        for i in live:
            self.assign(reqs[i], _column(host_tokens, host_finite, i, jobs[i].drafts))

    def assign(self, req: Request, drafts: list[int]) -> None:
        """`drafts` become the ones `req`'s next step verifies (cut where its grammar cannot take them)."""
        req.draft_ids = _grammar_prefix(req, drafts)

    @torch.inference_mode()
    def launch(
        self,
        ran: list[tuple[ScheduledChunk, torch.Tensor]],  # a step's verify chunks, with their hidden rows
        verify: PendingVerify,  # their acceptance, queued on the device
        ahead: VerifyAhead | None = None,  # the verify step was planned ahead: its chunks' starts move on by this
    ) -> PendingDrafts | None:
        """Queue the next drafts behind a step of verify chunks, before the host reads the step: the
        MTP layer's first pass covers every position each chunk computed, its input tokens the
        acceptance's candidates (an accepted draft is its own candidate, the first rejected position's
        candidate is the step's new token), and the later passes start at each request's last
        accepted position (`PaddedDraft.run`'s `accepted`). The rows past that position compute
        nothing used; the KV rows they write lie past the request's last token, and the next step's
        first pass writes them again before any pass reads them. Each request drafts k; `collect` keeps
        what its next step may verify. None when the step cannot be queued so (no padded drafting
        step, no pages for the furthest draft, a draft past max_model_len): then `propose` runs after
        the step is read."""
        if self.padded is None or self.k < 1:
            return None
        jobs = []
        most = 0 if ahead is None else self.k  # how far a chunk planned ahead may still move on
        for c, hidden in ran:
            req, n = c.request, 1 + len(c.drafts)
            end = c.start + most + n + self.k - 1  # tokens up to the furthest draft's position
            if end + 1 > self.max_model_len or not self.reserve(req, end):
                return None
            first = self._chunk(req, [0] * n, c.start)  # its tokens: the candidates, on the device
            later = [self._chunk(req, [0], c.start + step) for step in range(1, self.k)]  # + accepted, on the device
            jobs.append(DraftJob(first, hidden[:n], later, self.k))
        if not self.padded.fits(jobs):
            return None
        shift = None if ahead is None else ahead.shift
        tokens, finite = self.padded.run(jobs, verify.candidates, verify.accepted, shift)
        return PendingDrafts(self, [c.request for c, _ in ran], tokens, finite)

    def _eager(self, jobs: list[DraftJob]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass by pass: the MTP layer over every job's first chunk, then again on its own output and
        the draft before, one position on, for the jobs that want that many drafts, the tokens staying
        on the device. Returns (tokens, finite) [K, len(jobs)] (K: the most drafts a job wants)."""
        device = self.model.device
        batch = ForwardBatch.build([j.first for j in jobs], self.kv.page_size, device)
        h = self.model.draft(batch, torch.cat([j.hidden for j in jobs]), self.kv, self.states)  # [T, H]
        h = h[(torch.tensor(batch.seq_lens).cumsum(0) - 1).tolist()]  # [n, H]: each job's last position
        tokens = torch.zeros(max(j.drafts for j in jobs), len(jobs), dtype=torch.long, device=device)
        finite = torch.zeros(tokens.shape, dtype=torch.bool, device=device)
        for step in range(tokens.shape[0]):
            rows = [i for i, j in enumerate(jobs) if j.drafts > step]
            index = host_to_device(torch.tensor(rows), device)
            if step > 0:  # the draft before is the input token: set on the device (no host read)
                batch = ForwardBatch.build([jobs[i].later[step - 1] for i in rows], self.kv.page_size, device)
                batch.input_ids = tokens[step - 1, index]
                h = h.index_copy(0, index, self.model.draft(batch, h[index], self.kv, self.states, step))
            logits = self.model.logits(h[index])
            tokens[step, index] = logits.argmax(-1)
            finite[step, index] = torch.isfinite(logits).all(-1)
        return tokens, finite

    def _chunk(self, req: Request, tokens: list[int], start: int) -> SequenceChunk:
        """MTP rows at positions start.. (row t: the token at t + 1), on the base weights."""
        assert req.state_slot is not None
        end = start + len(tokens)
        return SequenceChunk(
            token_ids=tokens,
            context_len=start,
            state_slot=req.state_slot,  # (the MTP layer is attention only: no state is read)
            pages=req.pages,
            positions=req.mm.positions.window(start, end) if req.mm is not None else None,
        )
