"""Next-token sampling and logprobs for a batch of requests.

Order (as vLLM): repetition / frequency / presence penalties → temperature → top-k → top-p →
min-p → sample with the request's own generator. Reported logprobs are those of the raw model
distribution (log_softmax of the logits before penalties and temperature).
"""

from __future__ import annotations

import random

import torch

from hylora.engine.request import Request, TokenLogprob


class SamplingError(RuntimeError):
    """This request's row cannot be sampled; it fails alone."""


def sample(
    logits: torch.Tensor, requests: list[Request], eos_ids: tuple[int, ...] = ()
) -> list[tuple[int, TokenLogprob | None] | SamplingError]:
    """logits [N, V] fp32 (finite, or -inf where a grammar forbids), one row per request → (token
    id, logprob info or None) per request, or the SamplingError that ends that request alone.
    `eos_ids` are suppressed, with the request's stop_token_ids, until its min_tokens are out."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    out: list[tuple[int, TokenLogprob | None] | SamplingError] = []
    for i, req in enumerate(requests):
        try:
            out.append(_sample_row(logits[i], raw_logprobs[i], req, eos_ids))
        except Exception as e:
            error = e if isinstance(e, SamplingError) else SamplingError(f"sampling failed: {e!r}")
            out.append(error)
    return out


def _sample_row(
    logits: torch.Tensor, raw_logprobs: torch.Tensor, req: Request, eos_ids: tuple[int, ...] = ()
) -> tuple[int, TokenLogprob | None]:
    p = req.params
    row = logits.clone()
    vocab = row.shape[0]
    if p.min_tokens and len(req.output_ids) < p.min_tokens and not (req.grammar and req.grammar.is_terminated()):
        banned = [t for t in (*eos_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row[banned] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids], device=row.device)
    row = _penalise(row, req)
    if torch.isnan(row).any():
        raise SamplingError("the logits became NaN after the repetition / frequency / presence penalties")
    if not torch.isfinite(row).any():
        raise SamplingError("every token is forbidden (grammar, min_tokens and logit_bias leave nothing to sample)")
    if p.greedy:
        token = int(row.argmax())
    else:
        probs = _filtered_probs(row / p.temperature, p.top_k, p.top_p, p.min_p)
        total = probs.sum()
        if not (torch.isfinite(probs).all() and total > 0):
            raise SamplingError(
                "no token has a finite, positive probability after penalties, temperature "
                f"{p.temperature:g}, top_k / top_p / min_p; relax them"
            )
        token = int(torch.multinomial(probs, 1, generator=_generator(req, logits.device)))
    info = token_logprob(raw_logprobs, token, p.logprobs) if p.logprobs is not None else None
    return token, info


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs.topk(k)
        top = {int(t): float(v) for t, v in zip(ids, values, strict=True)}
    value = logprobs[token]
    rank = int((logprobs > value).sum()) + 1
    return TokenLogprob(token_id=token, logprob=float(value), top=top, rank=rank)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] at prompt positions p..p+n-1 → logprob of the prompt token that follows each."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return [token_logprob(logprobs[j], t, k) for j, t in enumerate(next_ids)]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for i, req in enumerate(requests):
        _penalise(logits[i], req)
    return logits


def _penalise(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition (over prompt and output), frequency and presence (over output) penalties, in place."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        ids = torch.tensor(req.output_ids, dtype=torch.long, device=row.device)
        counts = torch.zeros(row.shape[0], device=row.device).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float32)
        )
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return row


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[0]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= top_p
        drop[0] = False  # always keep the most likely token
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.generator is None:
        seed = req.params.seed if req.params.seed is not None else random.SystemRandom().getrandbits(63)
        req.generator = torch.Generator(device=device).manual_seed(seed)
    return req.generator
