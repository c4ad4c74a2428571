"""Build engines on the tiny test checkpoint with three PEFT adapters; drive them step by step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hylora.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

ADAPTERS = ("gdn_attn", "rs_mlp", "all_linear")


def make_engine(ckpt: Path, adapter_root: Path | None = None, **config) -> LLMEngine:
    config.setdefault("device", "cpu")
    config.setdefault("max_lora_rank", 16)
    config.setdefault("fault_injection", True)  # the fault-isolation tests make requests fault on purpose
    lora = {name: adapter_root / name for name in ADAPTERS} if adapter_root else None
    return LLMEngine(ckpt, EngineConfig(**config), lora_modules=lora, progress=False)


def run(
    engine: LLMEngine,
    arrivals: dict[int, list[tuple]],
    max_steps: int = 100_000,
    before_step: Callable[[int], None] = lambda step: None,
) -> dict[str, RequestOutput]:
    """arrivals: step → [(request_id, prompt ids, SamplingParams, adapter[, media[, StructuredSpec]])]
    (a spec is compiled by the engine's grammar compiler). Returns final outputs. `before_step(step)`
    runs before each engine step (e.g. to make a request fault there)."""
    done: dict[str, RequestOutput] = {}
    expected = sum(len(v) for v in arrivals.values())
    for step in range(max_steps):
        for rid, prompt, params, adapter, *extra in arrivals.get(step, []):
            mm, spec = (extra + [None, None])[:2]
            grammar = engine.grammar_compiler().compile_blocking(spec) if spec is not None else None
            engine.add_request(rid, prompt, params, adapter, mm=mm, grammar=grammar)
        before_step(step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) >= expected and not engine.has_unfinished():
            return done
    raise AssertionError(f"not finished after {max_steps} steps")


def run_alone(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, adapter=None) -> RequestOutput:
    return run(engine, {0: [(rid, prompt, params, adapter)]})[rid]


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True, **kw)


def max_logprob_diff(a: RequestOutput, b: RequestOutput) -> float:
    assert a.logprobs is not None and b.logprobs is not None
    return max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))


def free_pages(engine: LLMEngine) -> int:
    """KV pages no request holds: pages only the prefix cache keeps are evictable, so free."""
    return engine.kv.num_pages - engine.stats().kv_used


def assert_all_freed(engine: LLMEngine) -> None:
    """Every request done, nothing in flight, every KV page and state slot back."""
    assert not engine.has_unfinished() and engine._inflight is None
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


def assert_a_fault_ahead_fails_alone(
    new_engine: Callable[[], LLMEngine],
    kind: str,
    faulty: tuple,
    healthy: tuple,
    steps: int,
    in_flight: Callable[[list], bool] = lambda chunks: True,
) -> LLMEngine:
    """After `steps` steps of requests "faulty" and "healthy" (a step planned ahead then in flight, whose
    chunks pass `in_flight`), "faulty" is made to fault ("nan" or "raise") in the next step queued: it
    fails with that error, and "healthy" gives the tokens it gives alone. Returns the engine."""
    reference = run(new_engine(), {0: [healthy]})["healthy"]
    engine = new_engine()
    engine.add_request(*faulty)
    engine.add_request(*healthy)
    for _ in range(steps):
        engine.step()
    assert engine._inflight is not None and in_flight(engine._inflight.chunks)
    engine.inject_fault("faulty", kind)  # hits the next step queued: one planned ahead
    out = run(engine, {})
    assert out["faulty"].finish_reason == "error"
    assert ("numerical fault" if kind == "nan" else "injected fault") in out["faulty"].error
    assert out["healthy"].error is None and out["healthy"].token_ids == reference.token_ids
    return engine


def assert_each_as_alone(
    outs: dict[str, RequestOutput],
    alone: dict[str, RequestOutput],
    aborted: str,
    faulted: str,
    inexact: dict[str, int] | None = None,
    poisoned: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Each request of a mixed run against itself run alone: the same tokens, finish reason and
    logprobs (within 1e-4). `aborted` may end "abort" with a prefix of its tokens alone, `faulted`
    with a numerical fault; a request that failed alone (a grammar and stop tokens that leave nothing
    to sample) fails the same way. `inexact`: request → max_tokens, checked for their length only (a
    seed under speculation draws differently, docs/SERVING.md). `poisoned`: requests whose media the
    tower fails on, which fail the same way alone."""
    inexact = inexact or {}
    assert outs.keys() == alone.keys()
    for rid, out in outs.items():
        want = alone[rid]
        if rid == aborted and out.finish_reason == "abort":
            assert rid in inexact or want.token_ids[: len(out.token_ids)] == out.token_ids, rid
            continue
        if rid == faulted and out.finish_reason == "error" and out.error != want.error:
            assert "numerical fault" in out.error
            continue
        assert want.error is None or "every token is forbidden" in want.error or rid in poisoned, (rid, want.error)
        assert out.error == want.error, rid
        if rid in inexact:
            assert (out.error is None) <= len(out.token_ids) <= inexact[rid], rid
            continue
        assert out.token_ids == want.token_ids, rid
        assert out.finish_reason == want.finish_reason, rid
        if want.logprobs:
            assert max_logprob_diff(out, want) <= 1e-4, rid
