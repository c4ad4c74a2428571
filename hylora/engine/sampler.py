"""Next-token sampling and logprobs for a batch of requests.

Order (as vLLM): repetition / frequency / presence penalties → temperature → top-k → top-p →
min-p → sample with the request's own generator. Reported logprobs are those of the raw model
distribution (log_softmax of the logits before penalties and temperature).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from hylora.engine.host_copy import HostCopy
from hylora.engine.request import Request, TokenLogprob
from hylora.ops.host_to_device import host_to_device
from hylora.ops.logits_scan import HAS_FINITE, HAS_NAN, scan_logits

Scan = Callable[[torch.Tensor], torch.Tensor]  # logits [N, V] fp32 → [2, N] int64 (greedy tokens, flags)


class SamplingError(RuntimeError):
    """This request's row cannot be sampled; it fails alone."""


# why a row cannot be sampled: the logits scan's flags (ops/logits_scan), and one bit of the sampler's
_NO_MASS = 8
_NAN_MESSAGE = "the logits became NaN after the repetition / frequency / presence penalties"
_ALL_FORBIDDEN_MESSAGE = "every token is forbidden (grammar, min_tokens and logit_bias leave nothing to sample)"


def sample(
    logits: torch.Tensor, requests: list[Request], eos_ids: tuple[int, ...] = (), scan: Scan = scan_logits
) -> list[tuple[int, TokenLogprob | None] | SamplingError]:
    """logits [N, V] fp32 (finite, or -inf where a grammar forbids), one row per request → (token
    id, logprob info or None) per request, or the SamplingError that ends that request alone.
    `eos_ids` are suppressed, with the request's stop_token_ids, until its min_tokens are out.
    `scan`: the logits scan kernel (the model's, `ModelKernels.logits_scan`)."""
    return launch_sample(logits, requests, eos_ids, scan).results()


class PendingSample:
    """A batch's draw, queued on the device: `tokens` [N] stays there (the next decode step can read
    it before the host has), `results()` brings it to the host with one wait."""

    def __init__(
        self,
        requests: list[Request],
        drawn: torch.Tensor,  # [2, N] int64 on the device: the tokens, each row's flags (why it cannot be sampled)
        failed: dict[int, SamplingError],
        logprobs: tuple[list[int], list[int], tuple[torch.Tensor, ...]] | None,  # rows, k, device tensors
    ) -> None:
        self.requests, self.tokens, self._failed, self._logprobs = requests, drawn[0], failed, logprobs
        self._host = HostCopy(drawn, *(logprobs[2] if logprobs else ()))

    def results(self) -> list[tuple[int, TokenLogprob | None] | SamplingError]:
        (tokens_host, flags_host), *lp_host = self._host.values()  # the one wait for the device
        infos = {}
        if self._logprobs is not None:
            wants, ks, _ = self._logprobs
            infos = dict(zip(wants, _logprobs_from_host(*lp_host, [tokens_host[i] for i in wants], ks), strict=True))
        out: list[tuple[int, TokenLogprob | None] | SamplingError] = []
        for i, req in enumerate(self.requests):
            flags = flags_host[i]
            if i in self._failed:
                out.append(self._failed[i])
            elif flags & HAS_NAN:
                out.append(SamplingError(_NAN_MESSAGE))
            elif not flags & HAS_FINITE:
                out.append(SamplingError(_ALL_FORBIDDEN_MESSAGE))
            elif flags & _NO_MASS:
                p = req.params
                out.append(
                    SamplingError(
                        "no token has a finite, positive probability after penalties, temperature "
                        f"{p.temperature:g}, top_k / top_p / min_p; relax them"
                    )
                )
            else:
                out.append((tokens_host[i], infos.get(i)))
        return out


def counts_tokens(req: Request) -> bool:
    """Its logits are edited by what it generated: penalties (they count the tokens), or min_tokens
    not met yet. Such a request's next tokens cannot be drawn several at once (speculation)."""
    p = req.params
    return (
        any(len(seq) > 1 for seq in p.bad_words_ids)
        or p.repetition_penalty != 1.0
        or bool(p.frequency_penalty)
        or bool(p.presence_penalty)
        or len(req.output_ids) < p.min_tokens
    )


def draws_without_host(req: Request) -> bool:
    """Its next draw needs nothing the host learns once this one is in: no grammar (its mask follows
    each token) and nothing `counts_tokens`. Its next token can be drawn before the host has read this
    one (decode ahead)."""
    return req.grammar is None and not counts_tokens(req)


def edits_logits(req: Request) -> bool:
    """`_edit_row` changes this request's row (else its logits are sampled as the model gave them)."""
    p = req.params
    return bool(p.allowed_token_ids or p.bad_words_ids or p.logit_bias) or counts_tokens(req)


def launch_sample(
    logits: torch.Tensor, requests: list[Request], eos_ids: tuple[int, ...] = (), scan: Scan = scan_logits
) -> PendingSample:
    """`sample`, queued: the whole batch is processed at once on the logits' device and nothing
    here waits for it (a per-row loop would wait three times per request). A batch of greedy rows
    without edits or logprobs is one pass of `scan` over the logits."""
    n, vocab = logits.shape
    failed: dict[int, SamplingError] = {}
    wants = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[wants], dim=-1) if wants else None  # the raw distribution's logprobs
    edited = [i for i, r in enumerate(requests) if edits_logits(r)]
    work = logits.clone() if edited else logits
    for i in edited:  # per-row edits: rare, and none waits for the device
        try:
            _edit_row(work[i], requests[i], eos_ids, vocab)
        except Exception as e:
            failed[i] = SamplingError(f"sampling failed: {e!r}")
    drawn = scan(work)  # [2, N]: the greedy rows' tokens (sampled rows are replaced below), the flags
    tokens, flags = drawn[0], drawn[1]
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        p = [requests[i].params for i in sampled]
        rows = to_device(sampled, logits.device)
        temperature = to_device([x.temperature for x in p], logits.device)
        probs = filtered_probs(
            work[rows] / temperature[:, None], [x.top_k for x in p], [x.top_p for x in p], [x.min_p for x in p]
        )
        good = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
        flags[rows] |= (~good).long() * _NO_MASS
        # exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i; each
        # request draws its q from its own generator, so a seed reproduces its tokens in any batch
        q = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            q[j].exponential_(generator=_generator(requests[i], logits.device))
        tokens[rows] = (torch.nan_to_num(probs, nan=0.0) / q.clamp_(min=1e-30)).argmax(-1)
    logprobs = None
    if wants:
        ks = [requests[i].params.logprobs or 0 for i in wants]
        logprobs = (wants, ks, _logprob_tensors(raw, tokens[to_device(wants, logits.device)], max(ks)))
    return PendingSample(requests, drawn, failed, logprobs)


def _edit_row(row: torch.Tensor, req: Request, eos_ids: tuple[int, ...], vocab: int) -> None:
    """allowed_token_ids, bad_words, min_tokens, logit_bias and penalties of one request, in place on
    its row."""
    p = req.params
    if p.allowed_token_ids:  # every other token to -inf (with a grammar too: the two masks intersect)
        keep = to_device(p.allowed_token_ids, row.device, torch.long)
        kept = row[keep]
        row.fill_(float("-inf"))
        row[keep] = kept
    if p.bad_words_ids:
        out = req.output_ids
        banned = [s[-1] for s in p.bad_words_ids if len(s) == 1 or out[len(out) - len(s) + 1 :] == s[:-1]]
        if banned:
            row[to_device(banned, row.device, torch.long)] = float("-inf")
    if p.min_tokens and len(req.output_ids) < p.min_tokens and not (req.grammar and req.grammar.is_terminated()):
        banned = [t for t in (*eos_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row[to_device(banned, row.device, torch.long)] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        row[to_device(ids, row.device, torch.long)] += to_device([p.logit_bias[t] for t in ids], row.device)
    _penalise(row, req)


def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """raw [n, V] logprobs, tokens [n] chosen → (their logprobs [n], ranks [n], top-k logprobs and
    ids [n, k]), on the device."""
    values = raw.gather(1, tokens[:, None])[:, 0]
    ranks = (raw > values[:, None]).sum(-1) + 1
    top_values, top_ids = raw.topk(k, dim=-1)
    return values, ranks, top_values, top_ids


def _logprobs_from_host(
    values: list[float], ranks: list[int], top_values: list, top_ids: list, tokens: list[int], ks: list[int]
) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=int(t),
            logprob=values[j],
            top=dict(zip(top_ids[j][: ks[j]], top_values[j][: ks[j]], strict=True)),
            rank=ranks[j],
        )
        for j, t in enumerate(tokens)
    ]


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """raw [n, V] logprobs, tokens [n] chosen → each row's TokenLogprob with its top-k alternatives."""
    host = HostCopy(*_logprob_tensors(raw, tokens, max(ks)), tokens).values()
    return _logprobs_from_host(*host, ks)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] at prompt positions p..p+n-1 → logprob of the prompt token that follows each."""
    next_tokens = to_device(next_ids, logits.device)
    return _logprobs(torch.log_softmax(logits, dim=-1), next_tokens, [k] * len(next_ids))


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for i, req in enumerate(requests):
        _penalise(logits[i], req)
    return logits


def _penalise(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition (over prompt and output), frequency and presence (over output) penalties, in place."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = to_device(sorted(set(req.all_ids)), row.device, torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        ids = to_device(req.output_ids, row.device, torch.long)
        counts = torch.zeros(row.shape[0], device=row.device).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float32)
        )
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return row


def filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """logits [n, V] (temperature applied) and per-row top_k (0 / -1 = off), top_p, min_p → the
    probabilities [n, V] with the filtered tokens at 0, each row renormalised. Which filters run is
    decided from the host lists, so nothing here waits for the device."""
    vocab, dev = logits.shape[-1], logits.device
    if any(0 < k < vocab for k in top_k):
        k = [k if 0 < k < vocab else vocab for k in top_k]
        kth = logits.topk(max(k), dim=-1).values.gather(1, to_device(k, dev)[:, None] - 1)
        off = to_device([not 0 < k < vocab for k in top_k], dev)[:, None]
        logits = logits.masked_fill((logits < kth) & ~off, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= to_device(top_p, dev)[:, None]
        drop &= to_device([p < 1.0 for p in top_p], dev)[:, None]
        drop[:, 0] = False  # always keep the most likely token
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    if any(m > 0.0 for m in min_p):
        floor = to_device(min_p, dev)[:, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row [V] through `filtered_probs`."""
    return filtered_probs(logits[None], [top_k], [top_p], [min_p])[0]


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.generator is None:
        seed = req.params.seed if req.params.seed is not None else random.SystemRandom().getrandbits(63)
        req.generator = torch.Generator(device=device).manual_seed(seed)
    return req.generator


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA through page-locked memory, so the copy
    is queued behind the model's step instead of waiting for it (a plain copy would)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)
