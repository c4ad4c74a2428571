"""Small building blocks: bias-free linear (and the one place that decides how LoRA runs), the two
RMSNorms, the SiLU MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hylora.lora import DeviceLoRABatch, LoRABatch, LoRAStack
from hylora.ops.fp8_linear.reference import Extra, QuantizedActivation, dequantize_weight, fp8_linear
from hylora.ops.lora.reference import lora_apply_grouped, lora_apply_masked, rank_mask
from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm
from hylora.ops.silu_mul.reference import silu_mul

if TYPE_CHECKING:  # (the Triton LoRA is imported where it runs: the package is optional)
    from hylora.ops.lora.triton import KernelConfig, LoRAKernelMeta

# Eager steps of fewer tokens (`Linear.stacked_below`, the kernel floor's lora_stacked_below) run the
# LoRA shrink inside the base GEMM when the triton backend is installed (Linear.stack_lora_a): h is then
# rounded to the model dtype once. Steps that take the delta first (below) do so at any size; the rest
# keep the shrink kernel and its fp32 h. 4096: BASELINE run 43 a (KernelsConfig.lora_stacked_below).
STACKED_LORA_BELOW = 4096
# Steps of at least `Linear.delta_first_from` tokens (the kernel floor's lora_delta_first_from) write
# the LoRA delta first and let the base GEMM accumulate onto it (`lora_apply_delta_first`), while the
# step's adapters need at most DELTA_FIRST_MAX_K extra GEMM inputs (slots x rank).
DELTA_FIRST_MAX_K = 256
LORA_BACKENDS = ("grouped", "masked", "triton")


def add_lora(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, lora: LoRABatch, backend: str | None) -> torch.Tensor:
    """y + each token's adapter delta, by `backend` (what the kernel floor chose for the linear:
    "triton" once hylora's LoRA kernels passed their start-up check; None: masked on CUDA, grouped
    on the CPU). A host batch runs the slices its adapters target; a device batch (CUDA graph) runs
    every slice, since the host does not know its adapters (absent slices and free slots are zeros)."""
    backend = backend or ("masked" if x.is_cuda else "grouped")
    on_device = isinstance(lora, DeviceLoRABatch)
    if backend == "grouped" and not on_device:
        return lora_apply_grouped(x, y, stack.a, stack.b, stack.offsets, stack.present, lora.groups)
    used = range(len(stack.a)) if on_device else stack.slices_used_by(lora.slots)
    if not used:
        return y  # no adapter of this batch targets this linear: exactly zero
    a, b, offsets = stack.pick(used)
    if backend == "triton":
        from hylora.ops.lora.triton import lora_apply

        return lora_apply(x, y, a, b, offsets, triton_meta(lora, stack.num_slots))
    num_slots, rank = stack.num_slots, stack.a[0].shape[1]
    mask = lora.memo(("rank_mask", num_slots, rank), lambda: rank_mask(lora.token_slots, num_slots, rank))
    return lora_apply_masked(x, y, a, b, offsets, mask)


def triton_meta(lora: LoRABatch, num_slots: int) -> LoRAKernelMeta:
    """The Triton kernels' token grouping of this step, built once per step for every linear."""
    from hylora.ops.lora.triton import LoRAKernelMeta

    return lora.memo(("triton", num_slots), lambda: LoRAKernelMeta.build(lora.token_slots, num_slots))


def _param(*shape: int) -> nn.Parameter:
    # Created empty (usually on the meta device); the loader assigns the checkpoint tensor.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ the batch's LoRA deltas). The unit LoRA attaches to.

    `slices` names the output row blocks: one for a plain projection, several when hylora fuses
    checkpoint projections into one GEMM (see model/packing.py). LoRA deltas are added per slice.
    """

    def __init__(self, in_features: int, slices: dict[str, int]):
        super().__init__()
        self.in_features = in_features
        self.slices = dict(slices)  # checkpoint module name → output rows
        self.out_features = sum(slices.values())
        self.weight = _param(self.out_features, in_features)
        self.lora: LoRAStack | None = None  # set by the adapter registry
        self.lora_backend: str | None = None  # set by the kernel floor (one of LORA_BACKENDS); None: by device
        self.delta_first_from = 0  # set by the kernel floor: steps of this many tokens take the delta first; 0: never
        self.stacked_below = STACKED_LORA_BELOW  # ... and eager steps of fewer tokens shrink in the base GEMM
        # [W; every slice's A] ([tail_weight; A] for FP8): those and the LoRA stack's A are views of it (stack_lora_a)
        self.stacked_weight: torch.Tensor | None = None
        self.compute_dtype = torch.float32
        # FP8 (set by the loader for a block-quantised checkpoint served on FP8 hardware): `weight` holds the
        # first `weight.shape[0]` output rows in e4m3, `weight_scale` their block scales
        # [ceil(rows / block_n), ceil(in / block_k)] (fp32), `tail_weight` the remaining rows unquantised
        # (the GDN in_proj's b and a rows, which Qwen keeps in bf16)
        self.register_buffer("weight_scale", None, persistent=False)
        self.quant_block: tuple[int, int] = (128, 128)
        self.register_buffer("tail_weight", None, persistent=False)
        self.fp8_kernel = fp8_linear  # ops.fp8_linear: the Triton kernel once the start-up check installs it

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations, outputs and LoRA tensors (an FP8 projection computes in the model's
        dtype, `compute_dtype`)."""
        return self.compute_dtype if self.is_fp8 else self.weight.dtype

    def set_fp8(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int],
        tail: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        """Serve this projection from FP8 rows (`weight` e4m3 [q, in], `scale` [ceil(q / block[0]), ...])
        followed by `tail` [out - q, in] in `dtype`."""
        rows = weight.shape[0] + (0 if tail is None else tail.shape[0])
        if rows != self.out_features or weight.shape[1] != self.in_features:
            want = [self.out_features, self.in_features]
            raise ValueError(f"FP8 rows {list(weight.shape)} and the tail do not make {want}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale, self.quant_block, self.tail_weight, self.compute_dtype = scale, block, tail, dtype

    def dequantize(self) -> None:
        """Back to one unquantised weight (the values FP8 stood for), e.g. when no FP8 kernel runs here."""
        if not self.is_fp8:
            return
        if self.stacked_weight is not None:
            raise RuntimeError("dequantize an FP8 projection before LoRA A is stacked beside it (stack_lora_a)")
        w = dequantize_weight(self.weight, self.weight_scale, self.quant_block, self.compute_dtype)
        if self.tail_weight is not None:
            w = torch.cat([w, self.tail_weight])
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale = self.tail_weight = None

    def base(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x Wᵀ without LoRA."""
        quantized = isinstance(x, QuantizedActivation)  # the producer quantised x for this FP8 GEMM
        if quantized and not self.is_fp8:
            raise ValueError("a quantised activation needs an FP8 projection")
        if not self.is_fp8:
            return F.linear(x, self.weight)
        if self.tail_weight is None:
            return self._fp8_gemm(x)
        values = x.x if quantized else x  # the unquantised rows' input
        if values is None:
            raise ValueError("a quantised activation needs its unquantised values (keep=True) for unquantised rows")
        # the unquantised rows in the FP8 GEMM's launch, their columns after its own: no second GEMM or copy
        return self._fp8_gemm(x, extra=(values, self.tail_weight))

    def _fp8_gemm(self, x: torch.Tensor | QuantizedActivation, extra: Extra | None = None) -> torch.Tensor:
        """The FP8 rows' GEMM, with `extra`'s 16-bit rows in the same launch (their columns after them)."""
        return self.fp8_kernel(x, self.weight, self.weight_scale, self.quant_block, extra=extra)

    def needs_input_values(self, lora: LoRABatch | None) -> bool:
        """Whether a quantised input must keep its unquantised values: for the unquantised rows, or
        for this batch's LoRA."""
        uses_lora = lora is not None and lora.has_adapters and self.lora is not None
        return self.tail_weight is not None or uses_lora

    @property
    def slice_offsets(self) -> list[tuple[int, int]]:
        offsets, start = [], 0
        for rows in self.slices.values():
            offsets.append((start, rows))
            start += rows
        return offsets

    def stack_lora_a(self, num_slots: int, rank: int) -> list[torch.Tensor]:
        """Move the unquantised weight rows into [W; A_0; A_1; ...] ([rows + slices * num_slots * rank, in])
        and return each slice's A [num_slots, rank, in] as a zeroed view of it. One GEMM over the whole
        buffer then gives those rows' outputs and every slot's x·Aᵀ: a decode step's LoRA shrink rides
        in the base GEMM. The rows are the whole weight, or for an FP8 projection its unquantised tail
        (none, or the GDN in_proj's b / a rows): the FP8 GEMM's MMAs cannot carry A, the 16-bit rows
        its launch serves beside them (`extra`) can. `weight` (`tail_weight`) stays [rows, in] (a
        view) with the same values."""
        rows = self.weight if not self.is_fp8 else self.tail_weight
        n, slices = 0 if rows is None else rows.shape[0], len(self.slices)
        stacked = torch.zeros(
            n + slices * num_slots * rank, self.in_features, dtype=self.dtype, device=self.weight.device
        )
        if rows is not None:
            stacked[:n] = rows
        if self.is_fp8:
            self.tail_weight = None if rows is None else stacked[:n]
        else:
            self.weight = nn.Parameter(stacked[:n], requires_grad=False)
        self.stacked_weight = stacked
        a = stacked[n:].view(slices, num_slots, rank, self.in_features)
        return [a[i] for i in range(slices)]  # (not unbind: its views may not be written in place)

    def forward(self, x: torch.Tensor | QuantizedActivation, lora: LoRABatch | None = None) -> torch.Tensor:
        y, expand = self.forward_unexpanded(x, lora)
        return y if expand is None else expand.apply(y)

    def forward_unexpanded(
        self, x: torch.Tensor | QuantizedActivation, lora: LoRABatch | None = None, all_slices: bool = False
    ) -> tuple[torch.Tensor, PendingExpand | None]:
        """(y, None) with y final, or, where the Triton LoRA ends in an expand kernel, (y without it, the
        expand), for a consumer that applies it in its own launch (MLP: silu_mul_lora). `all_slices`: the
        expand covers every slice (zero deltas where the step's adapters skip one), as such a consumer
        needs. FP8: the base GEMM takes the quantised x, LoRA its unquantised values."""
        if lora is None or self.lora is None or not lora.has_adapters:
            return self.base(x), None
        values = x.x if isinstance(x, QuantizedActivation) else x
        if values is None:
            raise ValueError("LoRA on a quantised activation needs its unquantised values (keep=True)")
        if self.lora_backend != "triton":
            return add_lora(values, self.base(x), self.lora, lora, self.lora_backend), None
        from hylora.ops.lora.triton import choose_config, lora_apply_delta_first, lora_shrink

        meta = triton_meta(lora, self.lora.num_slots)
        on_device, T = isinstance(lora, DeviceLoRABatch), values.shape[0]
        delta_first = (
            not self.is_fp8
            and not on_device
            and values.ndim == 2
            and 0 < self.delta_first_from <= T
            and len(lora.slots) * self.lora.a[0].shape[1] <= DELTA_FIRST_MAX_K
        )  # a long prefill step: the delta first, the base GEMM accumulating onto it
        if self.stacked_weight is not None and (on_device or (self.stacked_below > T and not delta_first)):
            # a decode step (its CUDA graph, or run eagerly with the graph's arithmetic), or a short prefill
            # step: shrink in a base GEMM
            y, h = self._stacked(x, values)
            return y, PendingExpand(h, self.lora.b, self.lora.offsets, meta)
        if delta_first:
            a, b, offsets = self.lora.pick(self.lora.slices_used_by(lora.slots))
            return lora_apply_delta_first(values, self.weight, a, b, offsets, meta, len(lora.slots)), None
        y = self.base(x)
        used = range(len(self.lora.a)) if on_device or all_slices else self.lora.slices_used_by(lora.slots)
        if not used:
            return y, None  # no adapter of this batch targets this linear: exactly zero
        a, b, offsets = self.lora.pick(used)
        config = choose_config(T, values.shape[1])
        return y, PendingExpand(lora_shrink(values, a, meta, config), b, offsets, meta, config)

    def _stacked(
        self, x: torch.Tensor | QuantizedActivation, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """y and every slot's h [1, T, slices, L, r] (rounded to the model dtype) from one GEMM launch: a
        16-bit GEMM over [W; A] (`stack_lora_a`), or for an FP8 projection its FP8 GEMM with the rows
        [unquantised tail; A] served in the same launch (their columns after the FP8 ones)."""
        T = values.shape[0]
        if not self.is_fp8:
            full = F.linear(values, self.stacked_weight)  # [T, out + slices * L * r]
        else:
            full = self._fp8_gemm(x, extra=(values, self.stacked_weight))
        y = full[:, : self.out_features]  # a view: the expand writes into it
        h = full[:, self.out_features :]
        return y, h.view(1, T, len(self.lora.a), self.lora.num_slots, self.lora.a[0].shape[1])


@dataclass
class PendingExpand:
    """A LoRA expand not yet applied: y[:, slice i] += each adapter token's h_i · B_i[slot]."""

    h: torch.Tensor  # [split, T, slices, r] fp32 shrink partials, or [1, T, slices, L, r] every slot's (16-bit)
    b: list[torch.Tensor]  # per slice [L, r, rows]
    offsets: list[tuple[int, int]]  # per slice (first column of y, rows)
    meta: LoRAKernelMeta
    config: KernelConfig | None = None  # None: by the step's size

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        from hylora.ops.lora.triton import lora_expand

        return lora_expand(self.h, self.b, self.offsets, y, self.meta, self.config)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: norm(x) * (1 + w), computed in fp32. With `residual`, the residual add
    is fused in front: returns (norm(residual + x), residual + x). With `rotary`, the rotary
    embedding is applied to the normed heads (the attention's q/k norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.kernel = rms_norm  # ops.rmsnorm: the Triton kernel once the start-up check installs it
        # ops.rmsnorm's rms_norm_quantized, set by the kernel floor for FP8 with dynamic or split activations: the
        # norm quantised for the FP8 projection behind it in the same launch, not by the GEMM's own
        self.kernel_quantized = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) [T, R], x [T, H, D]
        quantize_for: Linear | None = None,  # the projection that reads the norm, if it may take it quantised
        lora: LoRABatch | None = None,  # the batch's adapters (whether quantize_for's LoRA reads the norm)
    ) -> torch.Tensor | QuantizedActivation | tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        if quantize_for is not None and quantize_for.is_fp8 and self.kernel_quantized is not None:
            keep = quantize_for.needs_input_values(lora)
            return self.kernel_quantized(x, self.weight, self.eps, residual, quantize_for.quant_block[1], keep)
        if rotary is not None:
            return self.kernel(x, self.weight, self.eps, residual, rotary=rotary)
        return self.kernel(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """Output norm of the GDN layer: norm(x) * w * silu(z), plain weight, over heads [T, H, D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.kernel = gated_rms_norm  # ops.rmsnorm
        # ops.rmsnorm's gated_rms_norm_quantized, set by the kernel floor as RMSNorm.kernel_quantized
        self.kernel_quantized = None

    def forward(
        self,
        x: torch.Tensor,  # [T, H, D]
        z: torch.Tensor,  # [T, H, D]
        quantize_for: Linear | None = None,  # the projection that reads the norm as [T, H·D] rows
        lora: LoRABatch | None = None,
    ) -> torch.Tensor | QuantizedActivation:
        """[T, H, D], or [T, H·D] quantised for `quantize_for` (where its input groups hold whole heads)."""
        fused = quantize_for is not None and quantize_for.is_fp8 and self.kernel_quantized is not None
        if fused and x.shape[-1] % quantize_for.quant_block[1] == 0:
            group, keep = quantize_for.quant_block[1], quantize_for.needs_input_values(lora)
            return self.kernel_quantized(x, z, self.weight, self.eps, group, keep)
        return self.kernel(x, z, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, {"down_proj": hidden})
        self.act = silu_mul  # ops.silu_mul: silu(gate) * up
        # ops.silu_mul's silu_mul_quantized, set by the kernel floor when the down projection is FP8 with
        # dynamic or split activations: the activation quantised in the same launch, not by the GEMM's own
        self.act_quantized = None
        # ops.silu_mul's silu_mul_lora, set by the kernel floor with the Triton LoRA: gate_up's LoRA expand
        # applied in the activation's launch, not by its own kernel; where act_quantized quantises for the
        # down projection only if act_lora_quantizes (KernelsConfig.fused_lora_expand_quantized)
        self.act_lora = None
        self.act_lora_quantizes = False

    def forward(self, x: torch.Tensor | QuantizedActivation, lora: LoRABatch | None = None) -> torch.Tensor:
        quantize = self.act_quantized is not None and self.down_proj.is_fp8
        keep = self.down_proj.needs_input_values(lora)  # the down projection's LoRA reads the activation
        if self.act_lora is not None and (self.act_lora_quantizes or not quantize):
            gate_up, expand = self.gate_up_proj.forward_unexpanded(x, lora, all_slices=True)
            if expand is not None and len(expand.b) == 2:  # [gate | up], each its slice
                group = self.down_proj.quant_block[1] if quantize else None
                h = self.act_lora(gate_up, expand.h, expand.b, expand.meta, group, keep)
                return self.down_proj(h, lora)
            gate_up = gate_up if expand is None else expand.apply(gate_up)
        else:
            gate_up = self.gate_up_proj(x, lora)
        if quantize:
            return self.down_proj(self.act_quantized(gate_up, self.down_proj.quant_block[1], keep), lora)
        return self.down_proj(self.act(gate_up), lora)
