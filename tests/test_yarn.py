"""YaRN context extension (Qwen3.5 / Qwen3.6 model cards: `rope_type: yarn` for contexts past 262144
tokens, through vLLM's --hf-overrides): hylora's logits equal transformers' on a YaRN checkpoint, and
the same override given at serve time gives the same model."""

from __future__ import annotations

import pytest
import torch

from hylora.engine import EngineConfig, LLMEngine
from hylora.model.loader import load_model
from tests.conftest import TEXT_CONFIG, write_causal
from tests.helpers import hf_logits, hylora_logits, random_ids

ATOL = 1e-4
# a context of 64 positions stretched 4x: prompts of 300 tokens reach far past the trained range
YARN = TEXT_CONFIG["rope_parameters"] | {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("yarn")
    return path, write_causal(path, max_position_embeddings=64, rope_parameters=YARN)


@pytest.mark.parametrize("n", [1, 63, 65, 300], ids=lambda n: f"len{n}")
def test_yarn_checkpoint_logits_equal_transformers(yarn_ckpt, causal_ckpt, n):
    path, ref = yarn_ckpt
    assert ref.model.rotary_emb.attention_scaling > 1  # transformers applies YaRN's temperature
    model = load_model(path, progress=False)
    assert model.config.yarn is not None and model.config.max_context == 256
    ids = random_ids(n, model.config.vocab_size, seed=n)
    ours = hylora_logits(model, ids)
    assert torch.isfinite(ours).all()
    assert (ours - hf_logits(ref, ids)).abs().max().item() <= ATOL
    if n > 1:  # the same weights with plain M-RoPE answer differently: the scaling is not a no-op
        plain = hf_logits(causal_ckpt[1], ids)
        assert (ours - plain).abs().max().item() > 100 * ATOL


def test_hf_overrides_serve_the_yarn_model_and_set_its_context(yarn_ckpt, causal_ckpt):
    """`--hf-overrides` on the plain checkpoint (same weights) serves exactly the YaRN checkpoint's model, and
    max_model_len may reach original_max_position_embeddings x factor (vLLM's rule), not past it."""
    path, ref = yarn_ckpt
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    overrides = {"max_position_embeddings": 64, "rope_parameters": yarn}  # merged over the plain rope_parameters
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=256, hf_overrides=overrides)
    engine = LLMEngine(causal_ckpt[0], config, progress=False)
    ids = random_ids(300, engine.model.config.vocab_size, seed=11)
    assert (hylora_logits(engine.model, ids) - hf_logits(ref, ids)).abs().max().item() <= ATOL
    with pytest.raises(ValueError, match=r"\(256, config.json's YaRN rope_parameters"):
        LLMEngine(causal_ckpt[0], EngineConfig(device="cpu", max_model_len=257, hf_overrides=overrides))


def test_doctor_checks_the_model_its_hf_overrides_make(yarn_ckpt, causal_ckpt):
    """`hylora doctor --hf-overrides` (as the server was started): the model it serves in-process and
    transformers' reference both read the overridden config, and the model directory is left as it was."""
    import argparse
    import json

    from transformers import Qwen3_5ForCausalLM

    from hylora.doctor.cli import _inputs, add_doctor_args
    from hylora.server.vllm_argv import vllm_argv

    plain_dir, (_, yarn_ref) = causal_ckpt[0], yarn_ckpt
    before = (plain_dir / "config.json").read_text()
    parser = argparse.ArgumentParser()
    add_doctor_args(parser)
    argv = [str(plain_dir), "--hf-overrides.max_position_embeddings", "64", "--lengths", "8"]
    argv += [f"--hf-overrides.rope_parameters.{key}={json.dumps(value)}" for key, value in YARN.items()]
    inputs = _inputs(parser.parse_args(vllm_argv(argv)))
    assert inputs.model_dir != plain_dir and (plain_dir / "config.json").read_text() == before
    ids = random_ids(300, yarn_ref.config.vocab_size, seed=5)
    want = hf_logits(yarn_ref, ids)
    reference = Qwen3_5ForCausalLM.from_pretrained(inputs.model_dir, dtype=torch.float32)
    assert (hf_logits(reference, ids) - want).abs().max().item() <= ATOL
    assert (hylora_logits(load_model(inputs.model_dir, progress=False), ids) - want).abs().max().item() <= ATOL
    bad = parser.parse_args([str(plain_dir), "--hf-overrides", '{"rope_parameters": {"rope_type": "longrope"}}'])
    with pytest.raises(ValueError, match="rope_type 'longrope' is not"):
        _inputs(bad)
