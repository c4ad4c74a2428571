"""CUDA graphs for decode steps and short steps (needs a CUDA device; skipped on the CPU).

A graph replay equals the same padded step run eagerly, bit for bit (logits, finiteness flags and
every byte of the caches); the engine with graphs gives the tokens and logprobs of the engine with
`enforce_eager`; a NaN poisoned into one request inside a graph fails that request alone; the eager
decode forward and the padded short step make no host sync; Python's cyclic collector cannot free an
unreachable graph in the middle of a capture.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from hylora.engine.cuda_graphs import CudaGraphDecode, CudaGraphShortStep, capture_graphs
from hylora.engine.padded_decode import PaddedDecode
from hylora.engine.runner import _decode_rows
from hylora.engine.short_step import PaddedShortStep
from hylora.model.forward_batch import ForwardBatch, SequenceChunk
from tests.decode_helpers import same_bits
from tests.engine_helpers import free_pages, greedy, make_engine, max_logprob_diff, run
from tests.helpers import random_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]
ADAPTER_OF = [None, "gdn_attn", "all_linear", "rs_mlp", None, "gdn_attn"]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def adapter_root(engine_adapter_root):
    return engine_adapter_root


def cuda_engine(causal_ckpt, adapter_root, dtype: str = "bfloat16", **config):
    # a small explicit KV cache (not 90% of the card: the tests copy the caches)
    config = dict(
        dict(max_model_len=600, max_num_seqs=8, max_num_batched_tokens=1024, num_pages=160, max_short_step_tokens=64),
        **config,
    )
    return make_engine(causal_ckpt[0], adapter_root, device="cuda", dtype=dtype, **config)


def prefilled(engine, adapters: list[str | None]) -> None:
    for i, adapter in enumerate(adapters):
        engine.add_request(f"r{i}", random_ids(17 + 29 * i, 320, seed=90 + i), greedy(16), adapter)
    engine.step()
    engine.step()


@pytest.mark.parametrize("mix", ["base", "mixed"])
def test_graph_replay_equals_the_eager_padded_step_bit_for_bit(causal_ckpt, adapter_root, mix, caplog):
    with caplog.at_level(logging.INFO, logger="hylora.engine.cuda_graphs"):
        engine = cuda_engine(causal_ckpt, adapter_root)
    assert isinstance(engine.runner.decode, CudaGraphDecode), engine.kernels
    assert "captured 8 decode CUDA graphs" in caplog.text  # buckets 1 2 4 8, with and without adapters
    prefilled(engine, ADAPTER_OF[:5] if mix == "mixed" else [None] * 5)
    rows = _decode_rows(engine.scheduler.schedule().chunks, 8)
    assert rows is not None and len(rows) == 5  # bucket 8: three padding rows
    kv, states = engine.kv, engine.states
    before = [t.clone() for t in (kv.k, kv.v, states.conv, states.recurrent)]

    graphed = engine.runner.decode.run(rows)
    after_graph = [t.clone() for t in (kv.k, kv.v, states.conv, states.recurrent)]
    for t, b in zip((kv.k, kv.v, states.conv, states.recurrent), before, strict=True):
        t.copy_(b)
    eager = PaddedDecode(engine.model, kv, states, 8, 600).run(rows)

    assert torch.equal(graphed.logits, eager.logits)
    assert graphed.finite_hidden == eager.finite_hidden == [True] * 5
    assert graphed.finite_logits == eager.finite_logits == [True] * 5
    for g, e in zip(after_graph, (kv.k, kv.v, states.conv, states.recurrent), strict=True):
        assert same_bits(g, e)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_engine_with_graphs_equals_enforce_eager(causal_ckpt, adapter_root, dtype):
    arrivals = {
        0: [(f"r{i}", random_ids(20 + 37 * i, 320, seed=i), greedy(40), a) for i, a in enumerate(ADAPTER_OF)],
        9: [("late", random_ids(33, 320, seed=50), greedy(24), "all_linear")],
    }
    outputs = {}
    for eager in (True, False):
        # without decode ahead: with it, step() calls hand out a step's tokens one call later, so the
        # late arrival would join one device step later than in the eager run (another batch mix)
        engine = cuda_engine(causal_ckpt, adapter_root, DTYPES[dtype], enforce_eager=eager, async_scheduling=False)
        assert (engine.runner.decode is None) == eager and (engine.runner.short is None) == eager
        short_steps = []
        if not eager:  # the late arrival's prompt joins decode rows: a short step
            replay = engine.runner.short.run

            def counted(seqs, *args, replay=replay, calls=short_steps, **kwargs):
                calls.append(len(seqs))
                return replay(seqs, *args, **kwargs)

            engine.runner.short.run = counted
        outputs[eager] = run(engine, arrivals)
        assert eager or short_steps
    tolerance = {"fp32": 1e-4, "bf16": 5e-2}[dtype]
    for rid, out in outputs[False].items():
        ref = outputs[True][rid]
        assert out.error is None and out.token_ids == ref.token_ids, rid
        assert max_logprob_diff(out, ref) <= tolerance, (rid, max_logprob_diff(out, ref))


def test_decode_ahead_changes_no_bit(causal_ckpt, adapter_root):
    # every request arrives at once and ends by length: the same batches run with and without it
    arrivals = {
        0: [(f"r{i}", random_ids(20 + 37 * i, 320, seed=i), greedy(12 + 5 * i), a) for i, a in enumerate(ADAPTER_OF)]
    }
    outputs = {}
    for ahead in (False, True):
        engine = cuda_engine(causal_ckpt, adapter_root, async_scheduling=ahead)
        replay, planned_ahead = engine.runner.decode.run, []

        def counted(rows, input_ids=None, replay=replay, planned_ahead=planned_ahead):
            planned_ahead.append(input_ids is not None)
            return replay(rows, input_ids)

        engine.runner.decode.run = counted
        outputs[ahead] = run(engine, arrivals)
        assert sum(planned_ahead) >= (20 if ahead else 0) and (ahead or not any(planned_ahead))
        assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots
    for rid, out in outputs[True].items():
        ref = outputs[False][rid]
        assert out.error is None and out.token_ids == ref.token_ids, rid
        assert [x.logprob for x in out.logprobs] == [x.logprob for x in ref.logprobs], rid


def test_fault_inside_a_graph_fails_one_request_and_a_probe_is_bit_identical(causal_ckpt, adapter_root):
    engine = cuda_engine(causal_ckpt, adapter_root)
    probe = ("probe", random_ids(64, 320, seed=3), greedy(8), "all_linear")
    before = run(engine, {0: [probe]})["probe"]
    batch = [(f"f{i}", random_ids(150 + i, 320, seed=10 + i), greedy(8), ADAPTER_OF[i % 6]) for i in range(6)]
    for request in batch:
        engine.add_request(*request)
    engine.step()  # prefilled; the next steps are graph replays
    engine.inject_fault("f1")
    faulted = run(engine, {})
    assert faulted["f1"].finish_reason == "error" and "numerical fault" in faulted["f1"].error
    assert all(o.error is None for rid, o in faulted.items() if rid != "f1")
    after = run(engine, {0: [("probe2", *probe[1:])]})["probe2"]
    assert after.token_ids == before.token_ids
    assert [x.logprob for x in after.logprobs] == [x.logprob for x in before.logprobs]


def test_eager_decode_forward_makes_no_host_sync(causal_ckpt, adapter_root):
    engine = cuda_engine(causal_ckpt, adapter_root, enforce_eager=True)
    prefilled(engine, ADAPTER_OF[:5])
    chunks = engine.scheduler.schedule().chunks
    seqs = [
        SequenceChunk(
            c.request.all_ids[c.start : c.start + 1], c.start, c.request.state_slot, c.request.pages,
            lora_slot=c.request.lora.slot if c.request.lora is not None else -1,
        )
        for c in chunks
    ]  # fmt: skip
    batch = ForwardBatch.build(seqs, engine.kv.page_size, "cuda")
    assert batch.is_decode and batch.lora is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            hidden = engine.model(batch, engine.kv, engine.states)
            logits = engine.model.logits(hidden)
            finite = torch.isfinite(logits).all(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite.all()


def _short_step_seqs(engine, verify: bool, new_len: int = 16) -> list[SequenceChunk]:
    """The next step's decode rows as 3-token verify chunks (spec slots and a spare page each), or
    with a new prompt of `new_len` tokens beside them."""
    kv, states = engine.kv, engine.states
    seqs = []
    for c in engine.scheduler.schedule().chunks:
        r = c.request
        lora = r.lora.slot if r.lora is not None else -1
        if verify:
            spec = [states.allocate() for _ in range(2)]
            ids = r.all_ids[c.start : c.start + 1] + [7, 8]
            pages = r.pages + kv.allocate(1)
            seqs.append(SequenceChunk(ids, c.start, r.state_slot, pages, lora_slot=lora, spec_slots=spec))
        else:
            seqs.append(SequenceChunk(r.all_ids[c.start : c.start + 1], c.start, r.state_slot, r.pages, lora_slot=lora))
    if not verify:
        slot = states.allocate()
        states.reset(slot)
        pages = kv.allocate(kv.pages_needed(new_len))
        seqs.append(SequenceChunk(random_ids(new_len, 320, seed=5), 0, slot, pages, lora_slot=seqs[1].lora_slot))
    return seqs


@pytest.mark.parametrize("shape", ["mixed", "verify", "long-tail"])
def test_short_step_graph_replay_equals_the_eager_padded_step_bit_for_bit(causal_ckpt, adapter_root, shape):
    """long-tail: a prompt's 100-token tail beside the decode rows (a prefill burst's last step), its
    GDN layers token by token."""
    engine = cuda_engine(causal_ckpt, adapter_root, max_num_seqs=16)  # state slots for the spec slots too
    prefilled(engine, ADAPTER_OF[:5])
    kv, states = engine.kv, engine.states
    seqs = _short_step_seqs(engine, verify=shape == "verify", new_len=100 if shape == "long-tail" else 16)
    # buckets 16, 24, 32 (or on to 128); its own graphs with spec slots (k = 2)
    args = (engine.model, kv, states, 128 if shape == "long-tail" else 32, 2, 600)
    graphs = CudaGraphShortStep(*args)
    caches = (kv.k, kv.v, states.conv, states.recurrent)
    before = [t.clone() for t in caches]

    graphed = graphs.run(seqs)
    graphed = [t.clone() for t in (graphed.hidden, graphed.logits, graphed.finite)]
    after_graph = [t.clone() for t in caches]
    for t, b in zip(caches, before, strict=True):
        t.copy_(b)
    eager = PaddedShortStep(*args).run(seqs)

    tokens = sum(len(s.token_ids) for s in seqs)
    assert tokens == {"verify": 15, "mixed": 21, "long-tail": 105}[shape]  # bucket 16, 24, 128: padding ran
    for g, e in zip(graphed, (eager.hidden, eager.logits, eager.finite), strict=True):
        assert torch.equal(g, e)
    assert graphed[2].all()
    for g, e in zip(after_graph, caches, strict=True):
        assert same_bits(g, e)


def test_padded_short_step_makes_no_host_sync(causal_ckpt, adapter_root):
    engine = cuda_engine(causal_ckpt, adapter_root, enforce_eager=True, max_num_seqs=16)
    prefilled(engine, ADAPTER_OF[:5])
    seqs = _short_step_seqs(engine, verify=True)
    short = PaddedShortStep(engine.model, engine.kv, engine.states, 32, 2, 600)
    short.buffers.fill(seqs, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            hidden, logits, finite = short.step(16, lora=True, spec=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite[:, :15].all()


def test_speculating_with_verify_and_drafting_graphs_keeps_greedy_output(causal_ckpt, adapter_root, tmp_path):
    from hylora.engine.cuda_graphs import CudaGraphDraft
    from tests.spec_helpers import write_mtp_checkpoint

    exact = write_mtp_checkpoint(causal_ckpt[0], tmp_path / "exact", "arranged", layer_scale=0.0)
    arrivals = {0: [(f"r{i}", random_ids(20 + 9 * i, 320, seed=i), greedy(24), a) for i, a in enumerate(ADAPTER_OF)]}
    config = dict(max_model_len=600, max_num_seqs=8, num_pages=160, dtype="float32", device="cuda")
    plain = run(make_engine(exact, adapter_root, **config), arrivals)
    engine = make_engine(exact, adapter_root, num_speculative_tokens=2, max_short_step_tokens=64, **config)
    assert isinstance(engine.runner.short, CudaGraphShortStep) and isinstance(engine.drafter.padded, CudaGraphDraft)
    spec = run(engine, arrivals)
    for rid, out in plain.items():
        assert spec[rid].error is None and spec[rid].token_ids == out.token_ids, rid
        assert max_logprob_diff(spec[rid], out) <= 1e-4, rid
    stats = engine.stats()  # (the head drafts the base model's tokens: the adapters' requests reject some)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


def test_an_unreachable_graph_is_not_freed_inside_a_capture():
    """Run 39 b: a capture failed when the collector freed a previous engine's graphs in its middle
    (destroying a graph is not permitted while a stream captures; it invalidates the capture). Here a
    graph becomes unreachable garbage inside the capture and the collector would run at every
    allocation: the capture must still succeed, and the graph is freed after it."""
    device = torch.device("cuda")
    x = torch.ones(4, device=device)
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.add(1)
    pending = [old]
    del old

    def step(key: int) -> tuple[torch.Tensor, ...]:
        if torch.cuda.is_current_stream_capturing() and pending:
            cycle = {"graph": pending.pop()}
            cycle["self"] = cycle  # reachable from nothing but itself: only the cyclic collector frees it
            del cycle
        _ = [[] for _ in range(1000)]  # allocations: each one may trigger the collector below
        return (x * key,)

    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graphs = capture_graphs("test", [3, 2], lambda key: None, step, device)
        assert gc.isenabled() and not pending
    finally:
        gc.set_threshold(*thresholds)
    for key, (graph, (y,)) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, key))
