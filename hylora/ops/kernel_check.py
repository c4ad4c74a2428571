"""Choose fast kernels only after they agree with the torch reference on this model's shapes.

Run once at engine start on CUDA: fla's gated delta rule is compared with the reference on
random inputs of the model's head sizes, at lengths straddling fla's 64-token chunks, a
decode-only batch and a mixed batch. On any mismatch or non-finite value the reference stays.
fp32 models keep the exact reference unless forced (fla's Triton dots run fp32 inputs in TF32,
~1e-3 relative). `HYLORA_GDN_BACKEND=reference|fla|auto` (auto: fla for bf16/fp16 when it passes).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from hylora.model.decoder import HybridDecoder
from hylora.model.layers import MLP, GatedRMSNorm, Linear, RMSNorm
from hylora.ops.gated_delta_rule import fla
from hylora.ops.gated_delta_rule.reference import varlen_gated_delta_rule as reference

log = logging.getLogger(__name__)
BATCHES = ([1, 1, 1, 1, 1], [1, 63, 64, 65, 129, 1], [257], [2, 1, 511])
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}  # fp32 only when forced


def select_kernels(model: HybridDecoder, page_size: int) -> dict[str, str]:
    """Check every fast kernel against its reference on this model's shapes and install the ones that
    pass; returns {kernel: what was chosen and why}. HYLORA_FAST_KERNELS=off keeps the references for
    the decode and LoRA kernels (the GDN prefill kernel has HYLORA_GDN_BACKEND)."""
    from hylora.ops.fast_kernel_check import FAST_KERNELS, select_fast_kernels

    kernels = {"gated_delta_rule": select_gdn_kernel(model)}
    if os.environ.get("HYLORA_FAST_KERNELS", "auto") == "off":
        verdicts = dict.fromkeys(FAST_KERNELS, "reference (HYLORA_FAST_KERNELS=off)")
    else:
        verdicts = select_fast_kernels(model, page_size)
    install_triton_kernels(model, [name for name, verdict in verdicts.items() if not verdict.startswith("reference")])
    return kernels | verdicts


def install_triton_kernels(model: HybridDecoder, names: list[str]) -> None:
    """Route the model's decode steps, LoRA, norms and MLP activation through hylora's Triton kernels
    and prefill attention through torch's fused SDPA (names from select_fast_kernels: FAST_KERNELS)."""
    for layer in model.layers:
        if "gdn_decode" in names and layer.is_linear:
            from hylora.ops.gdn_decode.triton import gdn_decode

            layer.linear_attn.decode_step = gdn_decode
        if "paged_decode_attention" in names and not layer.is_linear:
            from hylora.ops.paged_decode_attention.triton import paged_decode_attention

            layer.self_attn.decode_attention = paged_decode_attention
    if "lora" in names:
        for module in model.modules():
            if isinstance(module, Linear):
                module.lora_backend = "triton"
    if "causal_conv1d" in names:
        from hylora.ops.causal_conv1d.triton import causal_conv1d_by_slot

        for layer in model.layers:
            if layer.is_linear:
                layer.linear_attn.conv = causal_conv1d_by_slot
    if "gdn_recurrent" in names:
        from hylora.ops.gated_delta_rule.triton import recurrent_by_slot

        for layer in model.layers:
            if layer.is_linear:
                layer.linear_attn.short_prefill = recurrent_by_slot
    if "prefill_attention" in names:
        from hylora.ops.attention.flash import paged_attention

        for layer in model.layers:
            if not layer.is_linear:
                layer.self_attn.prefill_attention = paged_attention
    decoder = [*model.layers.modules(), model.norm]  # not the vision tower: it has norms of its own
    if "rms_norm" in names:
        from hylora.ops.rmsnorm import triton as norm_kernels

        for module in decoder:
            if isinstance(module, RMSNorm):
                module.kernel = norm_kernels.rms_norm
            elif isinstance(module, GatedRMSNorm):
                module.kernel = norm_kernels.gated_rms_norm
    if "silu_mul" in names:
        from hylora.ops.silu_mul.triton import silu_mul

        for module in decoder:
            if isinstance(module, MLP):
                module.act = silu_mul


def uninstall_fast_kernels(model: HybridDecoder) -> None:
    """Back to the torch references for everything `install_triton_kernels` routes (benchmarks
    compare the two in one process)."""
    from hylora.ops import causal_conv1d_by_slot, paged_attention
    from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm
    from hylora.ops.silu_mul.reference import silu_mul

    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.decode_step = None
            layer.linear_attn.short_prefill = None
            layer.linear_attn.conv = causal_conv1d_by_slot
        else:
            layer.self_attn.decode_attention = None
            layer.self_attn.prefill_attention = paged_attention
    for module in [*model.modules()]:
        if isinstance(module, Linear):
            module.lora_backend = None
        elif isinstance(module, RMSNorm):
            module.kernel = rms_norm
        elif isinstance(module, GatedRMSNorm):
            module.kernel = gated_rms_norm
        elif isinstance(module, MLP):
            module.act = silu_mul


def select_gdn_kernel(model: HybridDecoder) -> str:
    """Install the fastest gated-delta-rule kernel that passes; returns what was chosen, for the log."""
    choice = os.environ.get("HYLORA_GDN_BACKEND", "auto")
    if model.device.type != "cuda" or choice == "reference":
        return "reference"
    if model.dtype == torch.float32 and choice != "fla":
        return "reference (fp32 model: fla's Triton kernels would compute in TF32)"
    if not fla.is_available():
        if choice == "fla":
            raise RuntimeError("HYLORA_GDN_BACKEND=fla but fla (fla-core) is not importable")
        return "reference (fla not installed)"
    error = max(_relative_error(model, lens) for lens in BATCHES)
    tolerance = TOLERANCE[model.dtype]
    if not error <= tolerance:  # also catches NaN
        message = f"fla's gated delta rule disagrees with the reference (rel. error {error:.2e} > {tolerance:.0e})"
        if choice == "fla":
            raise RuntimeError(message)
        log.error("%s; serving with the reference kernel", message)
        return f"reference ({message})"
    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.delta_rule = fla.varlen_gated_delta_rule
    return f"fla (max rel. error {error:.1e} vs the reference)"


@torch.inference_mode()
def _relative_error(model: HybridDecoder, seq_lens: list[int]) -> float:
    c, dev, dtype = model.config, model.device, model.dtype
    g = torch.Generator(device=dev).manual_seed(sum(seq_lens))
    T, N = sum(seq_lens), len(seq_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    q = rand(T, c.linear_num_key_heads, c.linear_key_head_dim).to(dtype)
    k = rand(T, c.linear_num_key_heads, c.linear_key_head_dim).to(dtype)
    v = rand(T, c.linear_num_value_heads, c.linear_value_head_dim).to(dtype)
    decay = -F.softplus(rand(T, c.linear_num_value_heads)) * 0.5
    beta = torch.sigmoid(rand(T, c.linear_num_value_heads)).to(dtype)
    states = rand(N, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) * 0.1
    scale = c.linear_key_head_dim**-0.5
    o_ref, s_ref = reference(q, k, v, decay, beta, states, seq_lens, scale)
    o, s = fla.varlen_gated_delta_rule(q, k, v, decay, beta, states.clone(), seq_lens, scale)
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in ((o, o_ref), (s, s_ref))]
    return max(errors) if all(torch.isfinite(x).all() for x in (o, s)) else float("inf")
