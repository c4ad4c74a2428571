"""Next-token sampling and logprobs for a batch of requests.

Order (as vLLM): repetition / frequency / presence penalties → temperature → top-k → top-p →
min-p → sample with the request's own generator. Reported logprobs are those of the raw model
distribution (log_softmax of the logits before penalties and temperature).
"""

from __future__ import annotations

import random

import torch

from hylora.engine.request import Request, TokenLogprob


def sample(logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
    """logits [N, V] fp32, one row per request → (token id, logprob info or None) per request."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    processed = apply_penalties(logits.clone(), requests)
    out = []
    for i, req in enumerate(requests):
        p = req.params
        if p.greedy:
            token = int(processed[i].argmax())
        else:
            probs = _filtered_probs(processed[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            token = int(torch.multinomial(probs, 1, generator=_generator(req, logits.device)))
        info = None
        if p.logprobs is not None:
            info = token_logprob(raw_logprobs[i], token, p.logprobs)
        out.append((token, info))
    return out


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs.topk(k)
        top = {int(t): float(v) for t, v in zip(ids, values, strict=True)}
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] at prompt positions p..p+n-1 → logprob of the prompt token that follows each."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return [token_logprob(logprobs[j], t, k) for j, t in enumerate(next_ids)]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for i, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long, device=logits.device)
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
            ids = torch.tensor(req.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=torch.float32)
            )
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


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
