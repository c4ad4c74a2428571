"""hylora's decoder gives transformers' logits on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from tests.conftest import write_causal
from tests.helpers import hf_logits, hylora_logits, random_ids

ATOL = 1e-4
LENGTHS = [1, 63, 64, 65, 127, 128, 129, 400, 513, 1024]


@pytest.fixture(scope="module")
def causal_pair(causal_ckpt):
    path, ref = causal_ckpt
    return load_model(path, progress=False), ref


@pytest.mark.parametrize("n", LENGTHS, ids=lambda n: f"len{n}")
def test_causal_lm_logits(causal_pair, n):
    model, ref = causal_pair
    ids = random_ids(n, model.config.vocab_size, seed=n)
    ours, theirs = hylora_logits(model, ids), hf_logits(ref, ids)
    assert torch.isfinite(ours).all()
    assert (ours - theirs).abs().max().item() <= ATOL


@pytest.mark.parametrize("n", [1, 65, 400], ids=lambda n: f"len{n}")
def test_vl_wrapper_text_path(vl_ckpt, n):
    path, ref = vl_ckpt
    model = load_model(path, progress=False)
    assert model.config.is_multimodal
    ids = random_ids(n, model.config.vocab_size, seed=100 + n)
    assert (hylora_logits(model, ids) - hf_logits(ref, ids)).abs().max().item() <= ATOL


def test_varlen_batch_of_mixed_lengths(causal_pair):
    """Several sequences of different lengths, some already holding context, in one forward call."""
    model, ref = causal_pair
    runner = CachedRunner(model, num_slots=6, num_pages=256, page_size=16)
    prompts = {n: random_ids(n, model.config.vocab_size, seed=n + 7) for n in (1, 5, 64, 129, 300, 17)}
    seqs = {n: runner.add() for n in prompts}
    # two sequences get a head start so the batch mixes decode, continued prefill and fresh prefill
    runner.step([(seqs[300], prompts[300][:299]), (seqs[17], prompts[17][:10])])
    feeds = [(seqs[300], prompts[300][299:]), (seqs[17], prompts[17][10:])]
    feeds += [(seqs[n], prompts[n]) for n in (1, 5, 64, 129)]
    out = runner.step(feeds, all_logits=True)
    for (seq, tokens), logits in zip(feeds, out, strict=True):
        n = next(k for k, s in seqs.items() if s is seq)
        expected = hf_logits(ref, prompts[n])[-len(tokens) :]
        assert (logits - expected).abs().max().item() <= ATOL, f"sequence of length {n}"


@pytest.mark.parametrize("value_heads", [2, 4, 6], ids=lambda h: f"Hv/Hk={h // 2}")
def test_value_head_groups(tmp_path, value_heads):
    ref = write_causal(tmp_path, seed=3, linear_num_value_heads=value_heads)
    model = load_model(tmp_path, progress=False)
    ids = random_ids(130, model.config.vocab_size, seed=5)
    assert (hylora_logits(model, ids) - hf_logits(ref, ids)).abs().max().item() <= ATOL


def test_tied_embeddings_and_other_shapes(tmp_path):
    ref = write_causal(
        tmp_path,
        seed=4,
        tie_word_embeddings=True,
        num_hidden_layers=6,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        linear_conv_kernel_dim=3,
        layer_types=[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
        ],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    model = load_model(tmp_path, progress=False)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = random_ids(200, model.config.vocab_size, seed=6)
    assert (hylora_logits(model, ids) - hf_logits(ref, ids)).abs().max().item() <= ATOL


def test_a_model_without_attention_layers_serves(tmp_path):
    """A checkpoint cut to its first GDN layers (no attention layer: an empty KV cache) serves through the
    engine, prefix cache and chunked prefill included, and its greedy tokens are transformers' own."""
    from tests.engine_helpers import greedy, make_engine, run_alone

    ref = write_causal(tmp_path, seed=8, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    ids = random_ids(70, ref.config.vocab_size, seed=8)
    expected = []  # transformers' cache needs an attention layer: greedy by full forwards without it
    with torch.no_grad():
        for _ in range(6):
            expected.append(int(ref(torch.tensor([ids + expected]), use_cache=False).logits[0, -1].argmax()))
    engine = make_engine(tmp_path, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    assert engine.kv.k.shape[0] == 0
    for rid in ("first", "again"):  # the second finds the first's prefix cached
        out = run_alone(engine, rid, ids, greedy(6))
        assert out.error is None and out.token_ids == expected, rid
