"""A small OpenAI-compatible server for doctor's tests: a thin wrapper around hylora's engine that
answers like vLLM (`prompt_logprobs`, `return_tokens_as_token_ids`, echo + logprobs, streaming)
and can be told to fail the ways real deployments fail:

(a) `ignore_adapter`: requests for that adapter run on the base model (the adapter silently does nothing);
(b) `base_gets_adapter`: a base request that shares a batch with adapter requests runs with one of
    their adapters;
(c) `nan_after`: from that prompt position on, logprobs are NaN and the top token is token 0 (`!!!!`);
(d) `poison_after_long`: once a request with at least that many prompt tokens has run, every later
    request comes out NaN / token 0 (NaN that outlives its request);
and `noise`: every position's logprobs shift by a random N(0, noise²), new for every request (a
noisy, e.g. low-precision, server that is otherwise correct: the top tokens do not change).

`write_subtle_adapters` writes PEFT adapters whose effect on the doctor's text is modest, like
real task adapters (mean |Δ logprob| vs base ≈ 0.17-0.18, max ≈ 0.8-1.4 on 400 tokens).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from hylora.engine import EngineConfig, LLMEngine, SamplingParams
from hylora.engine.async_engine import AsyncEngine
from hylora.engine.engine import RequestOutput
from hylora.engine.request import TokenLogprob

BASE = "fake-base"
BATCH_WINDOW_S = 0.02  # a request waits this long before it runs, so requests sent together share a batch


@dataclass
class Faults:
    ignore_adapter: str | None = None  # (a)
    base_gets_adapter: bool = False  # (b)
    nan_after: int | None = None  # (c)
    poison_after_long: int | None = None  # (d)
    noise: float = 0.0  # σ of a per-position logprob shift, new for every request


@dataclass
class FakeServer:
    url: str
    engine: LLMEngine
    faults: Faults = field(default_factory=Faults)
    vllm_fields: bool = True  # False: ignore prompt_logprobs and return_tokens_as_token_ids (plain OpenAI)
    poisoned: bool = False
    in_flight: dict[int, str | None] = field(default_factory=dict)  # request → adapter, while it runs

    def reset(self, faults: Faults | None = None, vllm_fields: bool = True) -> None:
        self.faults, self.vllm_fields, self.poisoned = faults or Faults(), vllm_fields, False


def build_app(server: FakeServer, aengine: AsyncEngine) -> FastAPI:
    app = FastAPI()
    ids = itertools.count()
    tokenizer = server.engine.tokenizer

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": BASE, "object": "model", "parent": None}]
        data += [{"id": a, "object": "model", "parent": BASE} for a in server.engine.adapters.names()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if not server.vllm_fields:
            body = {k: v for k, v in body.items() if k not in ("prompt_logprobs", "return_tokens_as_token_ids")}
        model = body.get("model")
        if model != BASE and model not in server.engine.adapters.names():
            return _json({"error": {"message": f"model {model!r} does not exist"}}, 404)
        adapter = None if model == BASE else model
        prompt = list(body["prompt"])
        k = body.get("logprobs")
        wants_prompt = body.get("prompt_logprobs") is not None or (body.get("echo") and k is not None)
        n = next(ids)
        server.in_flight[n] = adapter
        try:
            await asyncio.sleep(BATCH_WINDOW_S)  # the batch forms
            f = server.faults
            if adapter is not None and adapter == f.ignore_adapter:
                adapter = None  # (a)
            if adapter is None and model == BASE and f.base_gets_adapter:
                others = [a for m, a in server.in_flight.items() if m != n and a is not None]
                adapter = others[0] if others else None  # (b)
            params = SamplingParams(
                max_tokens=body.get("max_tokens", 16),
                temperature=body.get("temperature", 1.0),
                ignore_eos=body.get("ignore_eos", False),
                logprobs=k,
                prompt_logprobs=(body.get("prompt_logprobs") or k or 0) if wants_prompt else None,
            )
            out = None
            async for o in await aengine.submit(f"fake-{n}", prompt, params, adapter):
                out = o
        finally:
            del server.in_flight[n]
        assert out is not None and out.finished
        if out.error:
            return _json({"error": {"message": out.error}}, 500)
        poisoned = server.poisoned
        if f.poison_after_long is not None and len(prompt) >= f.poison_after_long:
            server.poisoned = True  # (d): every later request
        if poisoned:
            out = _broken_from(out, 0)
        elif f.nan_after is not None:
            out = _broken_from(out, f.nan_after)  # (c)
        if f.noise:
            out = _noisy(out, f.noise, random.Random(n))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        if body.get("stream"):
            return StreamingResponse(_events(out, model, tokenizer, body), media_type="text/event-stream")
        return _json(_response(out, model, tokenizer, body, as_ids))

    return app


def _broken_from(out: RequestOutput, position: int) -> RequestOutput:
    """What NaN logits give: NaN logprobs and token 0 from `position` on."""

    def broken(lp: TokenLogprob | None, p: int, token: int | None = None) -> TokenLogprob | None:
        if lp is None or p < position:
            return lp
        return TokenLogprob(lp.token_id if token is None else token, math.nan, {0: math.nan})

    prompt = [broken(lp, p) for p, lp in enumerate(out.prompt_logprobs or [])] if out.prompt_logprobs else None
    n = len(out.prompt_token_ids)
    tokens = [0 if n + i >= position else t for i, t in enumerate(out.token_ids)]
    logprobs = [broken(lp, n + i, token=0) for i, lp in enumerate(out.logprobs)] if out.logprobs else None
    return RequestOutput(
        out.request_id, out.prompt_token_ids, tokens, "", True, out.finish_reason, token_ids=tokens,
        text="!" * len(tokens), logprobs=logprobs, prompt_logprobs=prompt,  # type: ignore[arg-type]
    )  # fmt: skip


def _noisy(out: RequestOutput, sigma: float, rng: random.Random) -> RequestOutput:
    """Every position's logprobs shifted by one draw of N(0, σ²): the ranking stays, the values move."""

    def shift(lp: TokenLogprob | None) -> TokenLogprob | None:
        if lp is None:
            return None
        e = rng.gauss(0.0, sigma)
        return TokenLogprob(lp.token_id, lp.logprob + e, {t: v + e for t, v in lp.top.items()})

    prompt = [shift(lp) for lp in out.prompt_logprobs] if out.prompt_logprobs else out.prompt_logprobs
    logprobs = [shift(lp) for lp in out.logprobs] if out.logprobs else out.logprobs
    return dataclasses.replace(out, prompt_logprobs=prompt, logprobs=logprobs)


def _ranked(lp: TokenLogprob) -> dict[str, dict[str, Any]]:
    """vLLM's prompt_logprobs entry: the top-k by rank, and the prompt token with its rank."""
    ranks = {t: r for r, t in enumerate(lp.top, start=1)}  # (top is in rank order)
    entries = {t: (v, ranks[t]) for t, v in lp.top.items()}
    entries.setdefault(lp.token_id, (lp.logprob, len(ranks) + 1))
    return {str(t): {"logprob": v, "rank": r, "decoded_token": ""} for t, (v, r) in entries.items()}


def _render(tokenizer, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else tokenizer.decode([token])


def _response(out: RequestOutput, model: str, tokenizer, body: dict[str, Any], as_ids: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
    if body.get("prompt_logprobs") is not None and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = [None if lp is None else _ranked(lp) for lp in out.prompt_logprobs]
    if body.get("logprobs") is not None:
        entries: list[TokenLogprob | None] = []
        if body.get("echo"):
            entries += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        entries += out.logprobs or []
        echoed = out.prompt_token_ids if body.get("echo") else []
        choice["logprobs"] = {
            "tokens": [_render(tokenizer, t, as_ids) for t in [*echoed, *out.token_ids]],
            "token_logprobs": [None if lp is None else lp.logprob for lp in entries],
            "top_logprobs": [
                None if lp is None else {_render(tokenizer, t, as_ids): v for t, v in lp.top.items()} for lp in entries
            ],
        }
    usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)}
    return {"id": out.request_id, "object": "text_completion", "model": model, "choices": [choice], "usage": usage}


async def _events(out: RequestOutput, model: str, tokenizer, body: dict[str, Any]):
    base = {"id": out.request_id, "object": "text_completion", "model": model}
    for t in out.token_ids:
        yield _sse(base | {"choices": [{"index": 0, "text": tokenizer.decode([t]), "finish_reason": None}]})
    yield _sse(base | {"choices": [{"index": 0, "text": "", "finish_reason": out.finish_reason}]})
    usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)}
    yield _sse(base | {"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _json(payload: dict[str, Any], status: int = 200) -> Response:
    # NaN is written as the literal NaN (as Python's json does): doctor must read it as non-finite
    return Response(json.dumps(payload), status_code=status, media_type="application/json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_server(
    model_dir: Path, adapters: dict[str, Path], max_model_len: int = 1024, dtype: str = "float32"
) -> Iterator[FakeServer]:
    """A FakeServer on 127.0.0.1 (in a thread of this process) serving `model_dir` with `adapters`."""
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=16, device="cpu", dtype=dtype)
    engine = LLMEngine(model_dir, config, lora_modules=adapters, progress=False)
    port = _free_port()
    server = FakeServer(url=f"http://127.0.0.1:{port}", engine=engine)
    aengine = AsyncEngine(engine).start()
    uv = uvicorn.Server(uvicorn.Config(build_app(server, aengine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        time.sleep(0.05)
    try:
        yield server
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        asyncio.run(aengine.shutdown(1.0))


# name → (LoraConfig kwargs, factor on PEFT's random B): effects of mean |Δ logprob| 0.17-0.18 on the demo
SUBTLE_ADAPTERS = {
    "subtle_attn": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"]), 0.08),
    "subtle_mlp": (dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]), 0.12),
    "subtle_all": (
        dict(r=16, lora_alpha=16, use_rslora=True, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
            "out_proj", "gate_proj", "up_proj", "down_proj",
        ]),
        0.03,
    ),
}  # fmt: skip


def write_subtle_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """PEFT adapters with random A and a small random B (PEFT's init_lora_weights=False, B scaled
    down) on the demo checkpoint, written by PEFT itself: small effects, like real task adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    paths = {}
    for i, (name, (kwargs, factor)) in enumerate(SUBTLE_ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(factor)
        model.save_pretrained(out / name)
        paths[name] = out / name
    return paths


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The demo model is too small to gain from a second CPU thread, and torch's threads spin badly
    when the cores are shared (10-100× slower under load): one thread, as `doctor --demo` uses."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
