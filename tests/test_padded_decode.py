"""Decode steps padded to a CUDA-graph bucket, run eagerly on the CPU (the graphs' plain twin).

The padded static-shape step must give the real rows what the unpadded eager step gives them,
and its padding rows must write nowhere live: every state slot, KV page and LoRA row the batch does
not own is NaN-filled (or foreign data) before the step and compared bit for bit after it. The
torch references run the step here; the Triton kernels (decode + LoRA) run it under Triton's CPU
interpreter. Capturing the graphs themselves needs CUDA (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

import numpy as np  # noqa: E402

from hylora.cache import PagedKVCache  # noqa: E402
from hylora.engine import EngineConfig  # noqa: E402
from hylora.engine import decode_batch as db  # noqa: E402
from hylora.engine.decode_batch import DecodeBuffers, DecodeRow, bucket_for, decode_buckets  # noqa: E402
from hylora.engine.padded_decode import PaddedDecode  # noqa: E402
from hylora.engine.runner import _decode_rows  # noqa: E402
from tests.decode_helpers import (  # noqa: E402
    assert_step_wrote_only_its_own,
    eager_step_on_copies,
    nan_fill_unowned,
    padded,
)
from tests.engine_helpers import free_pages, greedy, make_engine, max_logprob_diff, run  # noqa: E402
from tests.helpers import random_ids  # noqa: E402

NAN = float("nan")


@pytest.fixture(scope="module")
def adapter_root(engine_adapter_root):
    return engine_adapter_root


# --- buckets and buffers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [
        (1, [1]),
        (5, [1, 2, 4, 5]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
        (40, [1, 2, 4, 8, 16, 24, 32, 40]),
        (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
        (300, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300]),
    ],
)
def test_decode_buckets(max_num_seqs, expected):
    assert decode_buckets(max_num_seqs) == expected


def test_bucket_for_picks_the_smallest_that_fits():
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 17, 25, 33, 49, 64)] == [1, 2, 4, 8, 24, 32, 48, 64, 64]
    with pytest.raises(ValueError, match="largest decode bucket"):
        bucket_for(65, buckets)


def test_null_page_is_never_handed_out(causal_ckpt):
    from hylora.config import ModelConfig

    kv = PagedKVCache(ModelConfig.from_dir(causal_ckpt[0]), num_pages=5, page_size=4, dtype=torch.float32, device="cpu")
    assert kv.null_page == 5 and kv.k.shape[1] == 6 * 4  # storage for the null page, not in the pool
    assert kv.null_page not in kv.allocate(5) and kv.num_free == 0


def test_buffers_pad_every_row_past_the_batch():
    buffers = DecodeBuffers(max_batch=8, max_pages=6, page_size=4, null_page=9, device="cpu")
    many = [DecodeRow(10 + i, 4 * i + 1, i, list(range(i + 1)), lora_slot=i % 2) for i in range(6)]
    buffers.fill(many, 8)
    rows = [DecodeRow(7, 5, 3, [4, 2], lora_slot=1), DecodeRow(8, 0, 0, [6], positions=(9, 10, 11))]
    buffers.fill(rows, 4)  # fewer rows later: the stale values of rows 2.. must be replaced by padding
    f = buffers.staged[: db.FIELDS * 4].view(db.FIELDS, 4)
    batch = buffers.batch(4, lora=True, max_seq_len=24)
    assert batch.input_ids.tolist() == [7, 8, 0, 0]
    assert batch.positions.tolist() == [[5, 9, 0, 0], [5, 10, 0, 0], [5, 11, 0, 0]]
    assert f[db.SLOT].tolist() == [3, 0, -1, -1]  # GDN: padding reads and writes no slot
    assert f[db.KV_ROW].tolist() == [2 * 4 + 1, 6 * 4, 36, 36]  # padding writes the null page only
    assert f[db.LEN].tolist() == [6, 1, 0, 0]  # attention: padding attends to nothing
    assert f[db.LORA].tolist() == [1, -1, -1, -1] and batch.lora is not None
    assert batch.block_table[:2, :2].tolist() == [[4, 2], [6, 0]]
    assert batch.padded and batch.is_decode and batch.max_decode_len == 24
    assert buffers.batch(4, lora=False, max_seq_len=24).lora is None


def test_buffers_refuse_what_does_not_fit():
    buffers = DecodeBuffers(max_batch=4, max_pages=2, page_size=4, null_page=9, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill([DecodeRow(1, 0, 0, [0])] * 3, 2)
    with pytest.raises(ValueError, match="past its"):
        buffers.fill([DecodeRow(1, 4, 0, [0])], 1)
    with pytest.raises(ValueError, match="max_model_len"):
        buffers.fill([DecodeRow(1, 0, 0, [0, 1, 2])], 1)


def test_lora_metadata_of_a_padded_batch_groups_only_adapter_rows():
    from hylora.ops.lora.triton import LoRAKernelMeta

    slots = torch.tensor([2, -1, 0, 2, -1, -1, -1, -1])  # 4 real rows (one base), 4 padding rows
    meta = LoRAKernelMeta.build(slots, num_slots=3)
    assert meta.counts.tolist() == [1, 0, 2]  # padding and base rows belong to no slot
    order = meta.order.tolist()
    assert order[meta.starts[0] : meta.starts[0] + 1] == [2] and order[meta.starts[2] : meta.starts[2] + 2] == [0, 3]


# --- the padded step against the unpadded eager step --------------------------------------------

BATCHES = {  # request index → adapter; requests 3 and 4 are prefilled too but stay out of the step
    "base": [0, 4],
    "mixed": [0, 1, 2],
}
ADAPTER_OF = [None, "gdn_attn", "all_linear", "rs_mlp", None]
PROMPT_LENS = [13, 16, 31, 47, 20]  # 16: the new token opens a page


def _prefilled(causal_ckpt, adapter_root, fast: bool, quantization: str | None = None):
    engine = make_engine(
        causal_ckpt[0], adapter_root, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=512,
        quantization=quantization,
    )  # fmt: skip
    if fast:
        from hylora.kernels import model_kernels
        from hylora.kernels.select import fast_verdicts

        engine.model.use_kernels(model_kernels(fast_verdicts(["gdn_decode", "paged_decode_attention", "lora"])))
    for i, (n, adapter) in enumerate(zip(PROMPT_LENS, ADAPTER_OF, strict=True)):
        engine.add_request(f"r{i}", random_ids(n, 320, seed=80 + i), greedy(8), adapter)
    engine.step()  # every prompt prefilled, one token sampled each
    return engine


CASES = [  # (batch, forced bucket, Triton kernels under the interpreter: slow, so two cases; weights)
    pytest.param("base", None, False, None, id="base-smallest-bucket-references"),
    pytest.param("base", 8, False, None, id="base-bucket-8-references"),
    pytest.param("mixed", None, False, None, id="mixed-smallest-bucket-references"),
    pytest.param("mixed", 8, False, None, id="mixed-bucket-8-references"),
    pytest.param("mixed", 8, True, None, id="mixed-bucket-8-triton-interpreter"),
    # FP8 projections: the LoRA's h of every slot from a GEMM beside the FP8 one, padding rows included
    pytest.param("mixed", 8, True, "fp8", id="mixed-bucket-8-fp8-triton-interpreter"),
]


@pytest.mark.parametrize("mix, bucket, fast, quantization", CASES)
def test_padded_step_equals_unpadded_and_writes_nowhere_else(
    causal_ckpt, adapter_root, mix, bucket, fast, quantization
):
    if fast:
        pytest.importorskip("triton")
    engine = _prefilled(causal_ckpt, adapter_root, fast, quantization)
    plan = engine.scheduler.schedule()  # the next step (pages for the new tokens allocated)
    wanted = {f"r{i}" for i in BATCHES[mix]}
    chunks = [c for c in plan.chunks if c.request.request_id in wanted]
    assert len(chunks) == len(wanted) and all(c.num_tokens == 1 for c in chunks)
    nan_fill_unowned(engine)

    eager, eager_kv, eager_states, before, runner = eager_step_on_copies(engine, chunks)
    kv, states = engine.kv, engine.states
    runner.decode = PaddedDecode(engine.model, kv, states, max_num_seqs=8, max_model_len=96)
    if bucket is not None:
        runner.decode.buckets = [bucket]  # force padding rows
    padded = runner.execute(chunks)

    for c, a, b in zip(chunks, padded, eager, strict=True):
        assert a.is_finite() and b.is_finite(), c.request.request_id
        torch.testing.assert_close(a.sample_logits, b.sample_logits, rtol=1e-5, atol=1e-5)
    assert_step_wrote_only_its_own(kv, states, chunks, eager_kv, eager_states, before, rtol=1e-5, atol=1e-5)
    assert torch.isnan(states.recurrent[:, sorted(set(range(8)) - states._slots._allocated)]).all()


def test_decode_rows_only_for_single_token_steps_that_fit(causal_ckpt, adapter_root):
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=512)
    engine.add_request("a", random_ids(9, 320, seed=1), greedy(4))
    engine.add_request("b", random_ids(2, 320, seed=2), greedy(4), "rs_mlp")
    prefill = engine.scheduler.schedule().chunks
    assert _decode_rows(prefill, 4) is None  # several tokens per chunk: eager
    engine.step()
    engine.step()
    decode = engine.scheduler.schedule().chunks
    rows = _decode_rows(decode, 4)
    assert rows is not None and [r.context_len for r in rows] == [10, 3]
    b = decode[1].request
    assert rows[1].token_id == b.all_ids[3] and rows[1].lora_slot == b.lora.slot and rows[1].pages == b.pages
    assert _decode_rows(decode, 1) is None  # more sequences than the largest bucket


# --- the engine with padded decode steps --------------------------------------------------------


def test_engine_with_padded_decode_equals_eager(causal_ckpt, adapter_root):
    # 12 pages of 16 tokens cannot hold three 60 + 24 token requests at once: preemption; a late
    # arrival joins mid-decode; one request is aborted mid-decode.
    config = dict(max_model_len=128, num_pages=12, max_num_batched_tokens=64, max_num_seqs=6)
    first = [(f"p{i}", random_ids(60, 320, seed=70 + i), greedy(24), a) for i, a in enumerate(ADAPTER_OF[:3])]
    late = [
        ("late", random_ids(7, 320, seed=9), greedy(20), "rs_mlp"),
        ("gone", random_ids(5, 320, seed=8), greedy(30), None),
    ]
    arrivals = {0: first, 5: late}
    outputs = []
    for pad in (False, True):
        engine = make_engine(causal_ckpt[0], adapter_root, **config)
        if pad:
            padded(engine)
            nan_fill_unowned(engine)
        done, step = {}, 0
        while step < 2000 and (step <= max(arrivals) or engine.has_unfinished()):
            for rid, prompt, params, adapter in arrivals.get(step, []):
                engine.add_request(rid, prompt, params, adapter)
            if step == 12:
                assert engine.abort("gone")
            done |= {o.request_id: o for o in engine.step() if o.finished}
            step += 1
        outputs.append((engine, done))
    (_, eager), (engine, pad) = outputs
    assert sum(o.num_preemptions for o in pad.values()) > 0
    assert any(bucket > n for n, bucket in engine.runner.decode.calls)  # padding rows ran
    assert pad["gone"].finish_reason == "abort"
    for rid in ("p0", "p1", "p2", "late"):
        assert pad[rid].error is None and pad[rid].token_ids == eager[rid].token_ids, rid
        assert max_logprob_diff(pad[rid], eager[rid]) <= 1e-4, rid
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("ahead", [True, False], ids=["decode-ahead", "no-decode-ahead"])
def test_fault_in_a_padded_decode_step_fails_one_request_alone(causal_ckpt, adapter_root, ahead):
    def engine():
        # no prefix cache: its chunk cuts would change when the prompts finish prefilling, and this
        # compares the faulted run bit for bit with a reference of the same batch shapes
        config = dict(max_model_len=256, max_num_seqs=3, async_scheduling=ahead, enable_prefix_caching=False)
        return padded(make_engine(causal_ckpt[0], adapter_root, **config))

    faulty = ("faulty", random_ids(50, 320, seed=1), greedy(10), "gdn_attn")
    healthy = ("healthy", random_ids(70, 320, seed=2), greedy(10), "rs_mlp")
    # a reference with the faulted run's batch shapes: with decode ahead, the step after the fault
    # was queued before the fault was read, so the faulty row runs one step longer there
    ends_there = ("faulty", faulty[1], greedy(3 if ahead else 2), "gdn_attn")
    reference = run(engine(), {0: [ends_there, healthy]})
    e = engine()
    e.add_request(*faulty)
    e.add_request(*healthy)
    e.step()  # both prefilled
    e.inject_fault("faulty")  # its slot and pages now NaN; the next step is a padded decode step
    out = run(e, {})
    assert out["faulty"].finish_reason == "error" and "numerical fault" in out["faulty"].error
    # the faulted step still sampled every row before reading the flags: that row's draw was dropped
    assert out["faulty"].token_ids == reference["faulty"].token_ids[:1]
    assert out["healthy"].token_ids == reference["healthy"].token_ids
    assert [x.logprob for x in out["healthy"].logprobs] == [x.logprob for x in reference["healthy"].logprobs]
    assert e.runner.decode.calls[0] == (2, 2)


def test_cpu_runs_eagerly_and_enforce_eager_is_a_flag(causal_ckpt):
    from hylora.server.serve import add_serve_args

    engine = make_engine(causal_ckpt[0])
    assert engine.runner.decode is None  # no CUDA graphs on the CPU
    assert not EngineConfig().enforce_eager and EngineConfig(enforce_eager=True).enforce_eager
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["m", "--enforce-eager"]).enforce_eager and not p.parse_args(["m"]).enforce_eager


def test_padding_rows_match_the_host_layout():
    # the graph reads fields at offsets that depend on the bucket only
    buffers = DecodeBuffers(max_batch=4, max_pages=3, page_size=2, null_page=7, device="cpu")
    buffers.fill([DecodeRow(5, 3, 1, [0, 2])], 2)
    host = buffers.host.numpy()[: db.FIELDS * 2].reshape(db.FIELDS, 2)
    assert np.array_equal(host[:, 1], [0, 0, 0, 0, -1, 14, 0, -1])
