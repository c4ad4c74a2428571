"""Requests end where they should (stop strings, stop ids, length), stream valid text, and
bad requests get a clear error without disturbing anything."""

from __future__ import annotations

import asyncio

import pytest

from hylora.adapters.registry import UnknownAdapter
from hylora.engine import RequestError, SamplingParams
from hylora.engine.async_engine import AsyncEngine, EngineDead, Submission
from hylora.engine.detokenizer import TextStream
from hylora.engine.request import FailureKind
from hylora.tokenizer import load_tokenizer
from tests.engine_helpers import free_pages, make_engine, run, run_alone
from tests.helpers import random_ids


@pytest.fixture(scope="module")
def engine(causal_ckpt):
    return make_engine(causal_ckpt[0], max_model_len=256, max_num_batched_tokens=64)


def test_stop_strings_stop_ids_and_length(engine):
    prompt = random_ids(30, 320, seed=1)
    free = run_alone(engine, "free", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    text = free.text
    middle = len(text) // 2
    stop = next(
        text[i : i + 2] for i in range(middle, len(text)) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    cut = run_alone(engine, "cut", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    kept = run_alone(
        engine,
        "kept",
        prompt,
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.text == text[: text.find(stop) + len(stop)]
    third = free.token_ids[2]
    by_id = run_alone(
        engine,
        "id",
        prompt,
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[third]),
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(third) + 1]


def test_request_larger_than_the_whole_kv_cache_is_refused(causal_ckpt):
    small = make_engine(causal_ckpt[0], max_model_len=256, num_pages=4, page_size=16)
    with pytest.raises(RequestError, match="needs up to 5 KV pages .* the whole cache has 4"):
        small.add_request("big", random_ids(50, 320, seed=1), SamplingParams(max_tokens=30))
    out = run_alone(small, "fits", random_ids(40, 320, seed=1), SamplingParams(max_tokens=20, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_streamed_text_is_valid_utf8_and_adds_up(causal_ckpt):
    tok = load_tokenizer(causal_ckpt[0])
    text = "Pigments: 孔雀石 and ünïcode — done"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok, [], stop=[])
    pieces = []
    for t in ids:
        stream.append(t)
        pieces.append(stream.take(finished=False))
    pieces.append(stream.take(finished=True))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stream_never_emits_part_of_a_stop_string(causal_ckpt):
    tok = load_tokenizer(causal_ckpt[0])
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    stream = TextStream(tok, [], stop=["STOP"])
    emitted = ""
    for t in ids:
        hit = stream.append(t)
        emitted += stream.take(finished=hit is not None)
        if hit:
            break
    assert emitted == "abc "


def test_bad_requests_get_clear_errors_and_change_nothing(engine):
    pages = free_pages(engine)
    with pytest.raises(
        RequestError,
        match="maximum context length is 256 tokens; the request has 250 prompt tokens and asks for up to 16 more",
    ):
        engine.add_request("long", random_ids(250, 320, seed=1), SamplingParams())
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request("empty", [], SamplingParams())
    for bad in ([5, 999], [3, -1], [2.0], ["7"], [2**70], [1, True], [[4]]):
        with pytest.raises(RequestError, match=r"token ids must be in \[0, 320\)"):
            engine.add_request("oov", bad, SamplingParams())
    with pytest.raises(UnknownAdapter, match="no adapter named 'nope'"):
        engine.add_request("x", [1, 2], SamplingParams(), adapter="nope")
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams())
    run(engine, {})
    assert free_pages(engine) == pages and not engine.requests


def test_async_streams_and_cancellation(causal_ckpt):
    engine = make_engine(causal_ckpt[0], max_model_len=512, max_num_batched_tokens=32)
    pages = free_pages(engine)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = random_ids(40, 320, seed=2)
    expected = run_alone(engine, "ref", prompt, params)

    async def main():
        aengine = AsyncEngine(engine).start()

        async def collect(rid):
            pieces, last = [], None
            async for out in aengine.generate(rid, prompt, params):
                pieces.append(out.new_text)
                last = out
            return "".join(pieces), last

        results = await asyncio.gather(*(collect(f"s{i}") for i in range(4)))
        for text, last in results:
            assert last.finished and last.token_ids == expected.token_ids and text == expected.text

        async def leave_early():
            async for out in aengine.generate("early", random_ids(300, 320, seed=3), params):
                return out  # the client goes away after the first output

        await leave_early()
        for _ in range(500):
            if await aengine.call(lambda: not engine.has_unfinished()):
                break
            await asyncio.sleep(0.01)
        assert await aengine.call(lambda: free_pages(engine)) == pages
        with pytest.raises(RequestError, match="maximum context length"):
            async for _ in aengine.generate("too-long", random_ids(600, 320, seed=4), params):
                pass
        await aengine.shutdown(grace_seconds=1)

    asyncio.run(main())


def test_submit_many_admits_every_request_between_the_same_two_steps_or_none(causal_ckpt):
    """The n × prompts choices of one HTTP request: admitted one by one, each waited for an engine step
    of its own while the engine was busy. submit_many admits them all in one visit, and when one is
    refused (too long) none of the others is left running."""
    engine = make_engine(causal_ckpt[0], max_model_len=512, max_num_seqs=32)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    steps = 0
    admitted_at: dict[str, int] = {}
    real_step, real_add = engine.step, engine.add_request

    def counted_step():
        nonlocal steps
        steps += 1
        return real_step()

    def recorded_add(request_id, *args, **kwargs):
        admitted_at[request_id] = steps
        return real_add(request_id, *args, **kwargs)

    engine.step, engine.add_request = counted_step, recorded_add
    expected = run_alone(engine, "ref", random_ids(30, 320, seed=5), params)
    steps = 0

    async def main():
        aengine = AsyncEngine(engine).start()
        busy = await aengine.submit(
            "busy", random_ids(200, 320, seed=6), SamplingParams(max_tokens=200, ignore_eos=True)
        )
        while steps < 3:  # the engine is stepping
            await asyncio.sleep(0.01)
        choices = [Submission(f"c{i}", random_ids(30, 320, seed=5), params) for i in range(16)]
        streams = await aengine.submit_many(choices)
        assert len({admitted_at[c.request_id] for c in choices}) == 1  # between the same two steps
        for stream in streams:
            outs = [o async for o in stream]
            assert outs[-1].token_ids == expected.token_ids
        refused = [Submission(f"r{i}", random_ids(30, 320, seed=7), params) for i in range(3)]
        refused.append(Submission("too-long", random_ids(600, 320, seed=8), params))
        with pytest.raises(RequestError, match="maximum context length"):
            await aengine.submit_many(refused)
        assert await aengine.call(lambda: [r for r in engine.requests if r.startswith("r")]) == []
        aengine.abort("busy")
        async for _ in busy:
            pass
        for _ in range(500):
            if await aengine.call(lambda: not engine.has_unfinished()):
                break
            await asyncio.sleep(0.01)
        assert await aengine.call(lambda: free_pages(engine)) == engine.kv.num_pages
        await aengine.shutdown(grace_seconds=1)

    asyncio.run(main())


def test_forward_error_fails_only_the_request_that_caused_it(causal_ckpt):
    """A forward that raises with a batch in it: the batch recomputes one request at a time, the
    request that raises alone fails, its neighbours finish exactly as they would alone."""
    engine = make_engine(causal_ckpt[0], max_model_len=256, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {name: random_ids(20 + 7 * i, 320, seed=20 + i) for i, name in enumerate(["a", "b", "bad"])}
    alone = {name: run_alone(engine, f"ref-{name}", prompts[name], params) for name in ("a", "b")}
    engine.add_request("a", prompts["a"], params)
    engine.step()  # "a" is running when the offender arrives
    for name in ("bad", "b"):
        engine.add_request(name, prompts[name], params)
    engine.inject_fault("bad", "raise")
    out = run(engine, {})
    assert out["bad"].finish_reason == "error" and out["bad"].failure is FailureKind.INTERNAL
    assert "injected fault in the forward of request 'bad'" in out["bad"].error
    for name in ("a", "b"):
        assert out[name].finish_reason == "length" and out[name].token_ids == alone[name].token_ids, name
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


def test_bug_outside_any_request_ends_those_in_flight_and_engine_keeps_serving(causal_ckpt):
    """A bug in the step itself (not in one request's work) ends the requests in flight with an
    error output (never a silent end); the async engine then serves the next request normally."""
    engine = make_engine(causal_ckpt[0], max_model_len=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = run_alone(engine, "ref", random_ids(20, 320, seed=9), params)

    async def main():
        aengine = AsyncEngine(engine).start()
        real_schedule = engine.scheduler.schedule

        def broken(*args, **kwargs):
            engine.scheduler.schedule = real_schedule  # fail once
            raise RuntimeError("simulated bug")

        engine.scheduler.schedule = broken
        outs = [o async for o in aengine.generate("victim", random_ids(20, 320, seed=9), params)]
        assert outs[-1].finish_reason == "error" and "internal engine error" in outs[-1].error
        assert outs[-1].failure is FailureKind.INTERNAL
        outs = [o async for o in aengine.generate("next", random_ids(20, 320, seed=9), params)]
        assert outs[-1].token_ids == expected.token_ids
        assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots
        await aengine.shutdown(grace_seconds=1)

    asyncio.run(main())


def test_device_fault_ends_everything_and_stops_the_engine(causal_ckpt):
    engine = make_engine(causal_ckpt[0], max_model_len=256)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    fatal = []

    async def main():
        aengine = AsyncEngine(engine, on_fatal=fatal.append).start()
        neighbour = await aengine.submit("n", random_ids(20, 320, seed=1), params)
        faulty = await aengine.submit("f", random_ids(20, 320, seed=2), params, inject_fault="device")
        ends = [[o async for o in s][-1] for s in (neighbour, faulty)]
        for out in ends:
            assert out.finish_reason == "error" and out.failure is FailureKind.DEVICE_FAULT
            assert "device fault" in out.error and "restart" in out.error
        for _ in range(100):  # on_fatal comes from the engine thread right after the last output
            if fatal:
                break
            await asyncio.sleep(0.02)
        assert fatal and not aengine.alive
        with pytest.raises(EngineDead):
            await aengine.submit("late", [1, 2], params)

    asyncio.run(main())
