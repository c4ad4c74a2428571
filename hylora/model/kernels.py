"""Which kernel each layer of the decoder calls: one record, the torch references by default.

The kernel floor (`hylora.kernels`) checks the fast kernels against these references at start-up
and hands the model a `ModelKernels` naming the ones that passed; `HybridDecoder.use_kernels`
gives each layer its part. Nothing else rebinds a layer's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hylora import ops
from hylora.model.layers import STACKED_LORA_BELOW
from hylora.ops.causal_conv1d.reference import save_conv_states
from hylora.ops.fp8_linear.reference import fp8_linear
from hylora.ops.logits_scan.reference import scan_logits
from hylora.ops.output_gate.reference import output_gate
from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm
from hylora.ops.rotary.reference import rotate_half
from hylora.ops.silu_mul.reference import silu_mul

if TYPE_CHECKING:
    from hylora.model.decoder import HybridDecoder

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ModelKernels:
    # GDN layers
    delta_rule: Kernel = ops.varlen_gated_delta_rule  # the chunked gated delta rule of prefill
    conv: Kernel = ops.causal_conv1d_by_slot  # the prefill conv, conv state in place by slot
    gdn_decode: Kernel | None = None  # a fused decode step by state slot (None: the reference, when padded)
    gdn_recurrent: Kernel | None = None  # the delta rule token by token, for steps of short chunks only
    # an eager prefill step's leading one-token sequences token by token (KernelsConfig.gdn_single_tokens_recurrent)
    gdn_split_single_tokens: bool = False
    save_conv_states: Callable[..., None] = save_conv_states  # a verify step's conv state after each token
    # attention layers
    decode_attention: Kernel | None = None  # over the block table (None: the reference, when padded)
    prefill_attention: Kernel = ops.paged_attention
    output_gate: Kernel = output_gate  # o * sigmoid(gate), the o_proj's input
    # the output gate quantised for an FP8 o_proj in one launch (dynamic or split activations; None: unfused)
    output_gate_quantized: Kernel | None = None
    # every decoder layer (not the vision tower: it has norms of its own)
    rms_norm: Kernel = rms_norm
    gated_rms_norm: Kernel = gated_rms_norm
    silu_mul: Kernel = silu_mul
    fp8_linear: Kernel = fp8_linear  # the GEMM of FP8 projections (Linear.set_fp8)
    # silu_mul quantised for an FP8 down projection in one launch (dynamic or split activations; None: unfused)
    silu_mul_quantized: Kernel | None = None
    # rms_norm (gated_rms_norm) quantised for the FP8 projection behind it in one launch (dynamic or split
    # activations; None: unfused)
    rms_norm_quantized: Kernel | None = None
    gated_rms_norm_quantized: Kernel | None = None
    # silu_mul (or silu_mul_quantized) with gate_up's LoRA expand in its launch (the Triton LoRA only; None:
    # the expand kernel, then the activation)
    silu_mul_lora: Kernel | None = None
    silu_mul_lora_quantizes: bool = False  # ... also where it quantises for an FP8 down projection
    lora_backend: str | None = None  # model.layers.LORA_BACKENDS; None: masked on CUDA, grouped on the CPU
    tower_lora_backend: str | None = None  # the vision tower's linears
    lora_delta_first_from: int = 0  # triton LoRA: host steps of this many tokens write the delta first; 0: never
    lora_stacked_below: int = STACKED_LORA_BELOW  # triton LoRA: eager steps below this shrink inside the base GEMM
    tower_rotary: Kernel = rotate_half  # the vision tower's rotary on q and k, in place
    tower_attention: str | None = None  # the tower's SDPA backend (KernelsConfig.tower_attention); None: torch's pick
    # the logits: each row's greedy token and NaN / inf flags (the decode step's guard, the sampler)
    logits_scan: Kernel = scan_logits


def install(model: HybridDecoder, kernels: ModelKernels) -> None:
    """Give each layer of `model` its kernels from `kernels`."""
    from hylora.model.layers import MLP, GatedRMSNorm, Linear, RMSNorm
    from hylora.model.vision import VisionAttention, VisionLinear

    mtp_layers = list(model.mtp.layers) if model.mtp is not None else []
    for layer in [*model.layers, *mtp_layers]:
        if layer.is_linear:
            gdn = layer.linear_attn
            gdn.delta_rule, gdn.conv = kernels.delta_rule, kernels.conv
            gdn.decode_step, gdn.short_prefill = kernels.gdn_decode, kernels.gdn_recurrent
            gdn.split_single_tokens = kernels.gdn_split_single_tokens
            gdn.save_conv_states = kernels.save_conv_states
        else:
            layer.self_attn.decode_attention = kernels.decode_attention
            layer.self_attn.prefill_attention = kernels.prefill_attention
            layer.self_attn.output_gate = kernels.output_gate
            layer.self_attn.output_gate_quantized = kernels.output_gate_quantized
    mtp_modules = list(model.mtp.modules()) if model.mtp is not None else []
    for module in [*model.layers.modules(), model.norm, *mtp_modules]:
        if isinstance(module, RMSNorm):
            module.kernel, module.kernel_quantized = kernels.rms_norm, kernels.rms_norm_quantized
        elif isinstance(module, GatedRMSNorm):
            module.kernel, module.kernel_quantized = kernels.gated_rms_norm, kernels.gated_rms_norm_quantized
        elif isinstance(module, MLP):
            module.act, module.act_quantized = kernels.silu_mul, kernels.silu_mul_quantized
            module.act_lora = kernels.silu_mul_lora if kernels.lora_backend == "triton" else None
            module.act_lora_quantizes = kernels.silu_mul_lora_quantizes
    for module in model.modules():
        if isinstance(module, Linear):
            module.lora_backend, module.fp8_kernel = kernels.lora_backend, kernels.fp8_linear
            module.delta_first_from = kernels.lora_delta_first_from
            module.stacked_below = kernels.lora_stacked_below
        elif isinstance(module, VisionLinear):
            module.lora_backend = kernels.tower_lora_backend
        elif isinstance(module, VisionAttention):
            module.rotary, module.sdpa_backend = kernels.tower_rotary, kernels.tower_attention
