"""Tiny random-weight checkpoints of the real architecture, written by transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.triton_mode import interpret_without_cuda

# Before any module imports triton or a kernel: which test file pytest collects first must not decide
# whether the kernels are the interpreter's (a module imported compiled on a CPU cannot run them)
interpret_without_cuda()

from hylora.demo import write_tokenizer  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(4, os.cpu_count() or 1))

TEXT_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def text_config(**overrides):
    cfg = dict(TEXT_CONFIG)
    cfg.update(overrides)
    return cfg


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-init random weights so every path (norm weights, decays) matters in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def write_causal(path: Path, seed: int = 0, **overrides):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config(**overrides))).eval()
    randomise(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return model


def write_vl(path: Path, seed: int = 0, **overrides):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5Config(text_config=text_config(**overrides), vision_config=VISION_CONFIG)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    randomise(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, cfg.text_config.vocab_size)
    return model


@pytest.fixture(scope="session")
def causal_ckpt(tmp_path_factory):
    """(model_dir, transformers Qwen3_5ForCausalLM) sharing the same random weights."""
    path = tmp_path_factory.mktemp("causal")
    return path, write_causal(path)


@pytest.fixture(scope="session")
def vl_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl")
    return path, write_vl(path, seed=1)


@pytest.fixture(scope="session")
def mtp_ckpts(causal_ckpt, tmp_path_factory):
    """The causal test checkpoint with MTP heads (tests/spec_helpers.py): "arranged" (the model's own
    next tokens, decoder layers scaled by 0.1: most drafts accepted, some not), "exact" (acceptance 1),
    "random" (drafts almost always rejected) and "attending" (arranged, plus an attention whose output
    counts: its drafts depend on its KV rows and their positions)."""
    from tests.spec_helpers import write_mtp_checkpoint

    root, src = tmp_path_factory.mktemp("mtp"), causal_ckpt[0]
    return {
        "arranged": write_mtp_checkpoint(src, root / "arranged", "arranged", layer_scale=0.1),
        "exact": write_mtp_checkpoint(src, root / "exact", "arranged", layer_scale=0.0),
        "random": write_mtp_checkpoint(src, root / "random", "random", seed=3),
        "attending": write_mtp_checkpoint(
            src, root / "attending", "arranged", layer_scale=0.1, attention_scale=1.0, seed=5
        ),
    }


@pytest.fixture(scope="session")
def engine_adapter_root(causal_ckpt, tmp_path_factory):
    """PEFT adapters gdn_attn, rs_mlp, all_linear on the causal test checkpoint (for engine tests)."""
    from tests.engine_helpers import ADAPTERS
    from tests.lora_helpers import ADAPTER_SPECS, peft_adapter

    root = tmp_path_factory.mktemp("engine_adapters")
    for i, name in enumerate(ADAPTERS):
        peft_adapter(causal_ckpt[1], root / name, seed=60 + i, **ADAPTER_SPECS[name])
    return root


@pytest.fixture(scope="session")
def vl_media_ckpt(tmp_path_factory):
    """(model_dir, transformers Qwen3_5ForConditionalGeneration): a 2-block tower and media token ids
    inside the vocabulary, for image / video tests (tests/vl_helpers.py)."""
    from tests.vl_helpers import write_vl_media

    path = tmp_path_factory.mktemp("vl_media")
    return path, write_vl_media(path, seed=2)


@pytest.fixture(scope="session")
def demo_cache_dir(tmp_path_factory):
    """A HYLORA_CACHE_DIR holding the embedded demo (for servers started with --demo)."""
    from hylora.demo import ensure_demo

    path = tmp_path_factory.mktemp("hylora-cache")
    ensure_demo(path / "demo")
    return path


@pytest.fixture(scope="session")
def demo_dir(demo_cache_dir):
    return demo_cache_dir / "demo"


@pytest.fixture
def gpu_bf16(monkeypatch):
    """Triton's interpreter rounds fp32 → bf16 toward zero and multiplies bf16 tiles as raw
    integers; the GPU rounds to nearest even and multiplies the values. Make the interpreter do
    what the GPU does, so that the bf16 paths (casts, dots on 16-bit inputs) can be checked."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast, dot = builder.cast_impl, builder.create_dot

    def values(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype.scalar == tl.bfloat16 else h.data

    def cast_rtne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    def dot_values(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            return interpreter.TensorHandle(np.matmul(values(a), values(b)) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "cast_impl", cast_rtne)
    monkeypatch.setattr(builder, "create_dot", dot_values)
