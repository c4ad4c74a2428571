"""Short steps padded to a token bucket (engine/short_step.py), run eagerly on the CPU: the plain twin
of the short-step CUDA graphs (decode rows mixed with a prompt's last few tokens, verify steps).

The padded step must give every real token what the unpadded eager step gives it, and its padding
must write nowhere live: every state slot and KV page the step does not own is NaN-filled (or
foreign data) before the step and compared bit for bit after it. The torch references run it here;
the Triton kernels (conv, token-by-token GDN, decode attention, LoRA) under Triton's CPU interpreter.
Capturing the graphs needs CUDA (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

from hylora.engine import EngineConfig  # noqa: E402
from hylora.engine import short_step as ss  # noqa: E402
from hylora.engine.short_step import PaddedShortStep, ShortStepBuffers, fits_short_step, short_buckets  # noqa: E402
from hylora.model.forward_batch import SequenceChunk  # noqa: E402
from tests.decode_helpers import (  # noqa: E402
    assert_step_wrote_only_its_own,
    eager_step_on_copies,
    nan_fill_unowned,
)
from tests.engine_helpers import ADAPTERS, free_pages, greedy, make_engine, max_logprob_diff, run  # noqa: E402
from tests.helpers import random_ids  # noqa: E402
from tests.spec_helpers import write_mtp_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def adapter_root(engine_adapter_root):
    return engine_adapter_root


@pytest.fixture(scope="module")
def mtp_ckpt(causal_ckpt, tmp_path_factory):
    return write_mtp_checkpoint(causal_ckpt[0], tmp_path_factory.mktemp("mtp") / "arranged", "arranged", 0.1)


# --- buckets and buffers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_tokens, expected",
    [
        (0, []),
        (1, [1]),
        (16, [16]),
        (20, [16, 20]),
        (24, [16, 24]),
        (30, [16, 24, 30]),
        (128, [16, 24, 32, 48, 64, 96, 128]),
        (200, [16, 24, 32, 48, 64, 96, 128, 192, 200]),
    ],
)
def test_short_buckets(max_tokens, expected):
    assert short_buckets(max_tokens) == expected


def test_which_steps_fit():
    def seq(n, embeds=None, spec_slots=None):
        return SequenceChunk(list(range(n)), 0, 0, [0] * 8, embeds=embeds, spec_slots=spec_slots)

    assert fits_short_step([seq(1), seq(64)], 128)
    # a prefill burst's last step: decode rows and one prompt's long tail (token by token in the graph)
    assert fits_short_step([seq(1)] * 31 + [seq(97)], 128)
    assert not fits_short_step([seq(65, spec_slots=list(range(64)))], 128)  # a verify chunk past the spec columns
    assert fits_short_step([seq(64, spec_slots=list(range(63)))], 128)
    assert not fits_short_step([seq(3, spec_slots=[1, 2]), seq(65)], 128)  # spec columns for every chunk's tokens
    assert not fits_short_step([seq(60), seq(60), seq(9)], 128)  # more tokens than the largest bucket
    assert not fits_short_step([seq(4, embeds=(torch.tensor([0]), torch.zeros(1, 8)))], 128)  # media rows
    assert not fits_short_step([], 128)


def test_buffers_lay_out_tokens_sequences_and_padding():
    buffers = ShortStepBuffers(max_tokens=16, max_drafts=2, max_pages=4, page_size=4, null_page=9, device="cpu")
    stale = [
        SequenceChunk(list(range(10)), 0, 5, [1, 2, 3], lora_slot=1),
        SequenceChunk([1, 2], 0, 4, [0], spec_slots=[6]),
    ]
    buffers.fill(stale, 16)
    seqs = [
        SequenceChunk([11], 5, 3, [4, 2], lora_slot=1),  # a decode row
        SequenceChunk([21, 22, 23], 2, 0, [6, 8], spec_slots=[7, 8]),  # a verify chunk: 1 token + 2 drafts
        SequenceChunk([31, 32], 0, 2, [5], positions=torch.tensor([[0, 1], [0, 4], [0, 7]])),
    ]
    buffers.fill(seqs, 8)  # fewer tokens later: stale values must be replaced by padding
    batch = buffers.batch(8, lora=True, spec=True, max_seq_len=16)
    token_seq, starts = batch.seq_layout
    assert batch.input_ids.tolist() == [11, 21, 22, 23, 31, 32, 0, 0]
    assert batch.positions.tolist() == [[5, 2, 3, 4, 0, 1, 0, 0], [5, 2, 3, 4, 0, 4, 0, 0], [5, 2, 3, 4, 0, 7, 0, 0]]
    assert batch.kv_slot_mapping.tolist() == [2 * 4 + 1, 26, 27, 32, 20, 21, 36, 36]  # padding: the null page
    assert batch.decode_lens.tolist() == [6, 3, 4, 5, 1, 2, 0, 0]  # causal within a chunk; padding reads nothing
    assert batch.lora.token_slots.tolist() == [1, -1, -1, -1, -1, -1, -1, -1]
    assert token_seq.tolist() == [0, 1, 1, 1, 2, 2, 3, 4]  # each padding token its own sequence
    assert starts.tolist() == [0, 1, 4, 6, 7, 8, 8, 8, 8]
    assert batch.state_slots.tolist() == [3, 0, 2, -1, -1, -1, -1, -1]
    assert batch.seq_lens == [1, 3, 2, 1, 1, 0, 0, 0]
    assert batch.spec_slots.shape == (8, 63)  # a column per token after a chunk's first (chunks <= 64 tokens)
    assert batch.spec_slots[:3, :2].tolist() == [[-1, -1], [7, 8], [-1, -1]] and (batch.spec_slots[:, 2:] == -1).all()
    assert batch.block_table[:6, :2].tolist() == [[4, 2], [6, 8], [6, 8], [6, 8], [5, 0], [5, 0]]
    assert batch.padded and not batch.is_decode and batch.attends_by_row
    assert buffers.batch(8, lora=False, spec=False, max_seq_len=16).lora is None


def test_buffers_refuse_what_does_not_fit():
    buffers = ShortStepBuffers(max_tokens=8, max_drafts=1, max_pages=2, page_size=4, null_page=9, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill([SequenceChunk([1] * 5, 0, 0, [0, 1])], 4)
    with pytest.raises(ValueError, match="past its"):
        buffers.fill([SequenceChunk([1, 2], 3, 0, [0])], 8)
    with pytest.raises(ValueError, match="max_model_len"):
        buffers.fill([SequenceChunk([1], 0, 0, [0, 1, 2])], 8)
    with pytest.raises(ValueError, match="room for 1"):
        buffers.fill([SequenceChunk([1, 2, 3], 0, 0, [0], spec_slots=[4, 5])], 8)


# --- the padded step against the unpadded eager step --------------------------------------------

ADAPTER_OF = [None, "gdn_attn", "all_linear", None]
PROMPT_LENS = [13, 16, 31, 20]


def _mixed_plan(causal_ckpt, adapter_root, fast: bool, new_len: int = 16):
    """An engine whose next step mixes three decode rows with a new prompt of `new_len` tokens (with an
    adapter, and prompt logprobs: every position's logits, so attention must be causal in the chunk)."""
    engine = make_engine(
        causal_ckpt[0], adapter_root, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512,
        enable_prefix_caching=False,  # (its snapshot points would end the prompt's chunk at 64 tokens)
    )  # fmt: skip
    if fast:
        from hylora.kernels import model_kernels
        from hylora.kernels.select import fast_verdicts

        kernels = ["gdn_decode", "paged_decode_attention", "lora", "causal_conv1d", "gdn_recurrent"]
        engine.model.use_kernels(model_kernels(fast_verdicts(kernels)))
    for i, (n, adapter) in enumerate(zip(PROMPT_LENS[:3], ADAPTER_OF[:3], strict=True)):
        engine.add_request(f"r{i}", random_ids(n, 320, seed=80 + i), greedy(8), adapter)
    engine.step()  # every prompt prefilled, one token sampled each
    engine.add_request("new", random_ids(new_len, 320, seed=90), greedy(8, prompt_logprobs=1), "rs_mlp")
    return engine


@pytest.mark.parametrize(
    "bucket, fast, new_len",
    [
        pytest.param(None, False, 16, id="smallest-bucket-references"),
        pytest.param(64, False, 16, id="bucket-64-references"),
        pytest.param(32, True, 16, id="bucket-32-triton-interpreter"),
        # a chunk longer than an eager step runs token by token (the eager twin goes chunked)
        pytest.param(None, False, 90, id="long-tail-references"),
        pytest.param(None, True, 90, id="long-tail-triton-interpreter"),
    ],
)
def test_padded_short_step_equals_eager_and_writes_nowhere_else(causal_ckpt, adapter_root, bucket, fast, new_len):
    if fast:
        pytest.importorskip("triton")
    engine = _mixed_plan(causal_ckpt, adapter_root, fast, new_len)
    chunks = engine.scheduler.schedule().chunks
    assert sorted(c.num_tokens for c in chunks) == [1, 1, 1, new_len]
    nan_fill_unowned(engine)

    eager, eager_kv, eager_states, before, runner = eager_step_on_copies(engine, chunks)
    kv, states = engine.kv, engine.states
    runner.short = PaddedShortStep(engine.model, kv, states, max_tokens=128, max_drafts=0, max_model_len=128)
    if bucket is not None:
        runner.short.buckets = [bucket]  # force padding tokens
    calls = []
    step = runner.short.step
    runner.short.step = lambda *key: calls.append(key) or step(*key)
    padded = runner.execute(chunks)
    # 19 tokens: the 24 bucket unless forced; 93: the 96 bucket
    assert calls == [(bucket or ss.bucket_for(3 + new_len, short_buckets(128)), True, False)]

    tol = dict(rtol=2e-5, atol=2e-5) if fast else dict(rtol=1e-5, atol=1e-5)
    for c, a, b in zip(chunks, padded, eager, strict=True):
        assert a.is_finite() and b.is_finite(), c.request.request_id
        torch.testing.assert_close(a.sample_logits, b.sample_logits, **tol)
        torch.testing.assert_close(a.prompt_logits, b.prompt_logits, **tol)
    assert padded[-1].prompt_logits.shape[0] == new_len - 1
    assert_step_wrote_only_its_own(kv, states, chunks, eager_kv, eager_states, before, **tol)


# --- the engine with padded short steps ---------------------------------------------------------


def _record_short_steps(engine) -> list[tuple[int, int, bool]]:
    """(real tokens, bucket, verify) of every short step the engine runs from now on."""
    short = engine.runner.short
    assert short is not None
    calls, run_short = [], short.run

    def run_recorded(seqs, *args, **kwargs):
        n = sum(len(s.token_ids) for s in seqs)
        calls.append((n, ss.bucket_for(n, short.buckets), any(s.spec_slots for s in seqs)))
        return run_short(seqs, *args, **kwargs)

    short.run = run_recorded
    return calls


def test_engine_with_padded_short_steps_equals_eager(causal_ckpt, adapter_root):
    # prompts arrive while others decode: their chunks (at most 24 tokens a step) join decode rows;
    # with 12 pages of 16 tokens the three long requests preempt each other
    config = dict(max_model_len=128, num_pages=12, max_num_batched_tokens=24, max_num_seqs=6)
    arrivals = {
        0: [(f"p{i}", random_ids(40, 320, seed=70 + i), greedy(24), a) for i, a in enumerate(ADAPTER_OF[:3])],
        6: [("late", random_ids(30, 320, seed=9), greedy(20), "rs_mlp")],
        9: [("short", random_ids(5, 320, seed=8), greedy(12), None)],
    }
    eager = run(make_engine(causal_ckpt[0], adapter_root, **config), arrivals)
    engine = make_engine(causal_ckpt[0], adapter_root, padded_decode=True, max_short_step_tokens=32, **config)
    calls = _record_short_steps(engine)
    nan_fill_unowned(engine)
    padded = run(engine, arrivals)
    assert any(n < bucket for n, bucket, _ in calls)  # padding tokens ran
    assert sum(o.num_preemptions for o in padded.values()) > 0
    for rid in eager:
        assert padded[rid].error is None and padded[rid].token_ids == eager[rid].token_ids, rid
        assert max_logprob_diff(padded[rid], eager[rid]) <= 1e-4, rid
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("fast", [False, True], ids=["references", "triton-interpreted"])
def test_verify_steps_run_padded_and_keep_greedy_output(mtp_ckpt, adapter_root, fast):
    """(fast: the Triton kernels the GPU runs, the token-by-token GDN, the conv by slot and the
    per-token conv states among them, under the interpreter.)"""
    n = (lambda tokens: tokens // 3) if fast else (lambda tokens: tokens)  # the interpreter is slow
    arrivals = {
        0: [("base", list(range(3, 40)), greedy(n(20)), None), ("a0", list(range(5, 25)), greedy(n(17)), ADAPTERS[0])],
        2: [("a1", list(range(7, 30)), greedy(n(19)), ADAPTERS[1])],
        5: [("late", list(range(40, 52)), greedy(n(15)), None)],
    }
    config = dict(max_model_len=256, max_loras=3)
    plain = run(make_engine(mtp_ckpt, adapter_root, **config), arrivals)
    config |= dict(num_speculative_tokens=2, padded_decode=True, max_short_step_tokens=128)
    engine = make_engine(mtp_ckpt, adapter_root, **config)
    if fast:
        from hylora.kernels import model_kernels
        from hylora.kernels.select import fast_verdicts

        kernels = ["gdn_decode", "paged_decode_attention", "causal_conv1d", "gdn_recurrent", "save_conv_states"]
        engine.model.use_kernels(model_kernels(fast_verdicts(kernels)))
    calls = _record_short_steps(engine)
    spec = run(engine, arrivals)
    assert any(verify for *_, verify in calls)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids, rid
        assert max_logprob_diff(spec[rid], plain[rid]) <= 1e-4, rid
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


def test_fault_in_a_short_step_fails_one_request_alone(causal_ckpt, adapter_root):
    def engine(padded: bool):
        config = dict(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=24, enable_prefix_caching=False)
        return make_engine(causal_ckpt[0], adapter_root, padded_decode=padded, max_short_step_tokens=64, **config)

    faulty = ("faulty", random_ids(50, 320, seed=1), greedy(6), "gdn_attn")
    healthy = ("healthy", random_ids(70, 320, seed=2), greedy(6), "rs_mlp")
    reference = run(engine(False), {0: [healthy]})
    e = engine(True)
    calls = _record_short_steps(e)
    e.add_request(*faulty)
    e.add_request(*healthy)
    e.step()  # a first 24-token chunk of one prompt
    e.inject_fault("faulty")  # its slot and pages now NaN; its next chunks run in short steps
    out = run(e, {})
    assert calls and out["faulty"].finish_reason == "error" and "numerical fault" in out["faulty"].error
    assert out["healthy"].error is None and out["healthy"].token_ids == reference["healthy"].token_ids
    assert max_logprob_diff(out["healthy"], reference["healthy"]) <= 1e-4
    assert free_pages(e) == e.kv.num_pages and e.states.num_free == e.states.num_slots


def test_the_token_limit_is_a_flag_on_by_default_and_zero_turns_short_steps_off(causal_ckpt):
    from hylora.server.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["m"]).max_short_step_tokens == EngineConfig().max_short_step_tokens == 256
    assert p.parse_args(["m", "--max-short-step-tokens", "0"]).max_short_step_tokens == 0
    with pytest.raises(ValueError, match="max_short_step_tokens"):
        EngineConfig(max_short_step_tokens=-1)
    assert make_engine(causal_ckpt[0], padded_decode=True).runner.short.buckets[-1] == 256  # on by default
    assert make_engine(causal_ckpt[0], padded_decode=True, max_short_step_tokens=0).runner.short is None
    assert make_engine(causal_ckpt[0]).runner.short is None  # the CPU runs eagerly unless padded on purpose
