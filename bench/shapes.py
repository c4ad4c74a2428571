"""What the GPU benchmarks measure against, importable without the engine's server dependencies (a
kernel sweep needs no pydantic or llguidance): the Qwen3.6-27B text shape, a small twin of it, and
the card's copy rate that the rooflines divide by."""

from __future__ import annotations

import functools

BW_H200 = 4.3e12  # bytes/s, the copy rate the device tool's KINDS.md measured on an H200 (3.0e12 on an H100)


@functools.cache
def copy_rate() -> float:
    """This card's device-to-device copy rate in bytes/s (bytes read + written; the best of 10 copies of
    1 GiB, or a quarter of the free memory, after 3 warm-ups): the bandwidth a memory-bound kernel can
    reach, which every roofline divides by. Cached: the benches call it first, before their engine
    takes the memory. Until run 56 the benches divided by the H200's 4.3e12 on every card, which put an H100's
    (~3.0e12) floors ~30 % too low. BW_H200 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return BW_H200
    size = min(1 << 30, torch.cuda.mem_get_info()[0] // 4)
    if size < 256 << 20:  # a copy within a few L2 sizes would time the cache, not the memory
        raise RuntimeError("copy_rate: under 1 GiB of GPU memory free; call it before the engine takes the memory")
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for i in range(13):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size / best


QWEN36_27B = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=262144,  # Qwen3.6-27B's (transformers' default, 32768, would cap the 32k-token runs)
    mamba_ssm_dtype="float32",  # as Qwen3.6's config.json: vLLM keeps the GDN state in this dtype (bf16 without it)
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)
SMALL = dict(
    QWEN36_27B,
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters=dict(QWEN36_27B["rope_parameters"], mrope_section=[6, 5, 5]),
)
