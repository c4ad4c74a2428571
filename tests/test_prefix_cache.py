"""Issue 27: prefix caching for the hybrid model. A request whose prompt starts with a cached prefix
resumes from the cached KV pages and GDN state and answers as with caching off (CPU fp32: the same
greedy tokens, logprobs within 1e-4 — the tolerance of any change in how a prompt is split into
prefill chunks: the cached prefix was computed in other chunks than the uncached prompt, so fp32
sums run in another order; not bit for bit); a cache entry is only ever reused by the same adapter
version and the same media; eviction and faults leave no wrong state behind."""

from __future__ import annotations

import base64
import shutil

import pytest

from hylora.demo import DEMO_ADAPTERS
from hylora.engine import EngineConfig, LLMEngine, SamplingParams
from hylora.engine.chat_input import multimodal_prompt
from hylora.engine.errors import RequestError
from hylora.tokenizer import chat_prompt
from tests.engine_helpers import run
from tests.media_helpers import image_bytes

SYSTEM = "You are an archaeologist. " * 12  # a long shared system prompt (~70 tokens)
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=2)


def make(demo_dir, caching: bool = True, **config) -> LLMEngine:
    lora = {name: demo_dir / "adapters" / name for name in DEMO_ADAPTERS}
    config = {"device": "cpu", "dtype": "float32", "max_model_len": 1024, "fault_injection": True} | config
    return LLMEngine(demo_dir, EngineConfig(enable_prefix_caching=caching, **config), lora, progress=False)


def conversation(engine, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
        messages.append({"role": "user", "content": text})
    return chat_prompt(engine.tokenizer, messages)


def serve_one(engine, rid, prompt, adapter=None, params=PARAMS):
    return run(engine, {0: [(rid, prompt, params, adapter)]})[rid]


def same(a, b) -> None:
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4, (x, y)


@pytest.fixture(scope="module")
def engines(demo_dir):
    return make(demo_dir, True), make(demo_dir, False)


@pytest.mark.parametrize("adapter", [None, *DEMO_ADAPTERS])
def test_a_follow_up_turn_reuses_the_conversation_and_answers_the_same(engines, adapter):
    cached, plain = engines
    first = conversation(cached, "Describe the relic.")
    second = conversation(cached, "Describe the relic.", "And the tomb?")
    for engine in engines:
        serve_one(engine, f"{adapter}-1", first, adapter)
    hits = cached.prefix_cache.stats.hits
    with_cache = serve_one(cached, f"{adapter}-2", second, adapter)
    reused = cached.prefix_cache.stats.hits - hits
    assert reused > len(SYSTEM) // 8  # the system prompt and the first turn came from the cache
    assert with_cache.num_cached_tokens == reused  # what the request reports (usage.prompt_tokens_details)
    same(with_cache, serve_one(plain, f"{adapter}-2", second, adapter))


def test_the_system_prompt_is_shared_across_conversations_but_never_across_adapters(engines):
    cached, plain = engines
    for i, adapter in enumerate(["relic", "relic", "tomb", None]):
        prompt = conversation(cached, f"Question number {i}: where is the entrance?")
        hits = cached.prefix_cache.stats.hits
        out = serve_one(cached, f"share-{i}", prompt, adapter)
        reused = cached.prefix_cache.stats.hits - hits
        if i == 1:  # relic again: the system turn is cached for relic
            assert reused > 0
        same(out, serve_one(plain, f"share-{i}", prompt, adapter))
    by_adapter = cached.prefix_cache.stats.by_adapter
    assert by_adapter["relic"] > 0


def test_no_hit_across_adapters_or_a_reloaded_adapter(demo_dir, tmp_path):
    engine = make(demo_dir)
    prompt = conversation(engine, "Describe the mural.")
    follow = conversation(engine, "Describe the mural.", "Which pigments?")
    serve_one(engine, "a", prompt, "mural")
    before = engine.prefix_cache.stats.hits
    serve_one(engine, "b", follow, "tomb")  # another adapter: nothing of mural's may be reused
    serve_one(engine, "c", follow, None)  # nor by the base model
    assert engine.prefix_cache.stats.hits == before
    copy = tmp_path / "mural"
    shutil.copytree(demo_dir / "adapters" / "tomb", copy)
    engine.adapters.load("mural", copy)  # reload under the same name: a new version
    plain = make(demo_dir, False)
    plain.adapters.load("mural", copy)
    out = serve_one(engine, "d", follow, "mural")
    assert engine.prefix_cache.stats.hits == before  # the old version's entry is not the new one's
    same(out, serve_one(plain, "d", follow, "mural"))


def test_cache_salt_shares_entries_only_within_one_salt(demo_dir):
    """vLLM's cache_salt: a tenant's cached prefix serves only requests with the same salt (no hit,
    hence no timing, for another salt or none); answers stay those of the uncached engine."""
    engine, plain = make(demo_dir), make(demo_dir, False)
    prompt = conversation(engine, "Describe the relic.")
    follow = conversation(engine, "Describe the relic.", "And its age?")

    def served(rid, tokens, salt):
        engine.add_request(rid, tokens, PARAMS, "relic", cache_salt=salt)
        while engine.has_unfinished():
            finished = [o for o in engine.step() if o.finished and o.request_id == rid]
            if finished:
                return finished[0]
        raise AssertionError(rid)

    served("a", prompt, "tenant-a" * 6)
    for rid, salt in (("other salt", "tenant-b" * 6), ("no salt", None)):
        out = served(rid, follow, salt)
        assert out.num_cached_tokens == 0, rid
        same(out, serve_one(plain, rid, follow, "relic"))
    out = served("same salt", follow, "tenant-a" * 6)
    assert out.num_cached_tokens > len(SYSTEM) // 8
    same(out, serve_one(plain, "same salt", follow, "relic"))
    with pytest.raises(RequestError, match="cache_salt") as refused:
        engine.add_request("empty", prompt, PARAMS, cache_salt="")
    assert refused.value.param == "cache_salt" and "empty" not in engine.requests


def media_prompt(engine, png: bytes, question: str):
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]  # fmt: skip
    import asyncio

    return asyncio.run(multimodal_prompt(engine.media_settings(), engine.tokenizer, messages))


def test_same_image_hits_different_image_misses(demo_dir):
    cached, plain = make(demo_dir), make(demo_dir, False)
    image_a, image_b = image_bytes(96, 64, seed=1), image_bytes(96, 64, seed=2)
    runs = [("a1", image_a, "What is it?"), ("a2", image_a, "What colour is it?"), ("b1", image_b, "What is it?")]
    hits = []
    for rid, png, question in runs:
        before = cached.prefix_cache.stats.hits
        ids, mm = media_prompt(cached, png, question)
        out = run(cached, {0: [(rid, ids, PARAMS, None, mm)]})[rid]
        hits.append(cached.prefix_cache.stats.hits - before)
        ids2, mm2 = media_prompt(plain, png, question)
        same(out, run(plain, {0: [(rid, ids2, PARAMS, None, mm2)]})[rid])
    assert hits[0] == 0 and hits[1] > 0  # the same image, another question: the image is reused
    assert hits[2] == 0  # another image with the same placeholder ids: no reuse


def test_concurrent_sharers_with_mixed_adapters_and_eviction_stay_correct(demo_dir):
    cached = make(demo_dir, prefix_cache_states=2, num_pages=120, max_num_seqs=6)  # evicts all the time
    plain = make(demo_dir, False, num_pages=120, max_num_seqs=6)
    plan = [("relic", "Where?"), (None, "When?"), ("tomb", "Who?"), ("relic", "Why?"), ("mural", "How?")]
    for turn in range(2):
        arrivals = {
            step: [(f"t{turn}-{i}", conversation(cached, q, "More?")[: 200 if turn else None], PARAMS, adapter)]
            for step, (i, (adapter, q)) in enumerate(enumerate(plan))
        }
        got, want = run(cached, arrivals), run(plain, arrivals)
        for rid in want:
            same(got[rid], want[rid])
    assert len(cached.prefix_cache) <= 2


def test_a_faulted_request_leaves_no_entry_and_its_sharers_are_unharmed(demo_dir):
    engine, plain = make(demo_dir), make(demo_dir, False)
    prompt = conversation(engine, "Describe the relic.")
    follow = conversation(engine, "Describe the relic.", "Is it damaged?")
    serve_one(engine, "warm", prompt)  # the system turn and the question are cached
    entries = len(engine.prefix_cache)
    engine.add_request("bad", follow, PARAMS)
    engine.inject_fault("bad")  # NaN in what it writes
    engine.add_request("good", follow, PARAMS)
    outs = run(engine, {})
    assert outs["bad"].finish_reason == "error" and "numerical fault" in outs["bad"].error
    same(outs["good"], serve_one(plain, "good", follow))
    assert len(engine.prefix_cache) <= entries + 2  # "bad" added nothing (good may have)
    again = serve_one(engine, "again", follow)  # whatever is cached now is clean
    same(again, serve_one(plain, "again", follow))


def test_prompt_logprobs_requests_do_not_read_the_cache(engines):
    cached, plain = engines
    prompt = conversation(cached, "Describe the relic.", "And the tomb?")
    serve_one(cached, "pl-warm", prompt)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    before = cached.prefix_cache.stats.hits
    out = serve_one(cached, "pl", prompt, params=params)
    assert cached.prefix_cache.stats.hits == before  # vLLM's rule: no logits for a cached prefix
    assert len(out.prompt_logprobs) == len(prompt)
    ref = serve_one(plain, "pl", prompt, params=params)
    for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) <= 1e-4


def test_the_server_reports_cached_prompt_tokens_when_asked(demo_cache_dir, tmp_path):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens."""
    import httpx

    from tests.server_helpers import running_server

    args = ["--demo", "--device", "cpu", "--max-model-len", "1024", "--enable-prompt-tokens-details"]
    with running_server(args, demo_cache_dir, tmp_path / "log") as s:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe the relic."}]
        body = {"model": "hylora-demo", "messages": messages, "max_tokens": 2, "temperature": 0}
        usages = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json()["usage"] for _ in "ab"]
        salted = body | {"cache_salt": "b1Yv0Ym9Jq3nQ5l1kC1o4y0w8a6r2t9s7d3f5g1h0jA"}  # vLLM's per-tenant field
        salted_usages = [
            httpx.post(f"{s.url}/v1/chat/completions", json=salted, timeout=60).json()["usage"] for _ in "ab"
        ]
        empty = httpx.post(f"{s.url}/v1/chat/completions", json=body | {"cache_salt": ""}, timeout=60)
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]
    assert salted_usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}  # not the unsalted entries
    assert salted_usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
