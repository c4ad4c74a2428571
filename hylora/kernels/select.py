"""Choose fast kernels only after they agree with the torch reference on this model's shapes.

Run once at engine start: on CUDA each fast kernel (fla's gated delta rule, hylora's Triton decode,
LoRA, norm, activation, conv and vision-tower rotary kernels, torch's fused SDPA for prefill
attention) runs beside its reference on random inputs of the model's sizes at boundary lengths
(`checks.py`); a kernel serves only if it passed. The verdicts are records (`KernelVerdict`) the
engine keeps; the model gets one `ModelKernels` naming what passed. fp32 models keep the exact GDN
reference unless forced (fla's Triton dots run fp32 inputs in TF32, ~1e-3 relative).
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from hylora.kernels import checks, split_inputs
from hylora.kernels.config import FP8_GEMMS, KernelsConfig, triton_usable
from hylora.kernels.verdict import KernelVerdict, passed, reference
from hylora.kernels.warmup import warm_up_kernels
from hylora.model.decoder import HybridDecoder
from hylora.model.fp8 import dequantize_linears
from hylora.model.kernels import ModelKernels
from hylora.model.layers import Linear
from hylora.ops.gated_delta_rule import fla

log = logging.getLogger(__name__)
FAST_KERNELS = (
    "gdn_decode", "paged_decode_attention", "lora", "rms_norm", "silu_mul", "output_gate", "prefill_attention",
    "causal_conv1d", "gdn_recurrent", "save_conv_states", "tower_rotary", "logits_scan",
)  # fmt: skip
IMPLEMENTATION = {"prefill_attention": "flash"}  # what a passing kernel is, when not hylora's Triton
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# the module of hylora.ops.fp8_linear that serves each FP8 verdict's implementation (else "triton")
FP8_MODULES = {"deepgemm+cublas+triton": "deepgemm", "cublas+triton": "cublas"}
FP8_TOLERANCE = 1e-2  # the kernel vs the reference on the same FP8 inputs: fp32 sums in another order, bf16 out
GDN_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}  # fp32 only when forced
# a start-up check that takes longer is logged with its time: on a fresh machine the checks compile every
# Triton kernel (2-3 minutes of start-up at the 27B shape), which a warm Triton cache skips
SLOW_CHECK_S = 1.0


def select_kernels(
    model: HybridDecoder, page_size: int, config: KernelsConfig | None = None, max_step_tokens: int = 0
) -> dict[str, KernelVerdict]:
    """Check every fast kernel on this model's shapes, give the model the ones that pass, and return
    the verdict of each. Those that compile per shape at their first call compile now for steps of up
    to `max_step_tokens` tokens (kernels/warmup.py)."""
    config = config or KernelsConfig()
    verdicts = {"gated_delta_rule": select_gdn_kernel(model, config.gdn_backend)}
    if config.fast_kernels == "off":
        verdicts |= {name: reference(name, "fast kernels off") for name in FAST_KERNELS}
    else:
        verdicts |= select_fast_kernels(model, page_size, config)
    if any(isinstance(m, Linear) and m.is_fp8 for m in model.modules()):
        activations, deepgemm = config.fp8_activations, config.fp8_deepgemm
        verdicts["fp8_linear"] = select_fp8_kernel(model, config.fast_kernels, activations, deepgemm)
        if config.fp8_activations in ("dynamic", "split") and config.fp8_fused_quant:  # the producers quantise
            split = config.fp8_activations == "split"
            verdicts["silu_mul_quantized"] = select_silu_mul_quantized(model, config.fast_kernels, split)
            verdicts["output_gate_quantized"] = select_output_gate_quantized(model, config.fast_kernels, split)
            if config.fp8_fused_norm_quant:
                verdicts["rms_norm_quantized"] = select_rms_norm_quantized(model, config.fast_kernels, split)
    if config.fused_lora_expand:
        quantized, split = config.fused_lora_expand_quantized, config.fp8_activations == "split"
        verdicts["silu_mul_lora"] = select_silu_mul_lora(model, config.fast_kernels, quantized, split)
    if config.tower_attention != "auto":
        if model.visual is not None:
            verdicts["tower_attention"] = select_tower_attention(model, config.tower_attention)
        else:
            log.warning("tower_attention %r: no effect, no vision tower is loaded", config.tower_attention)
    model.use_kernels(model_kernels(verdicts, config))
    warm_up_kernels(model, verdicts, max_step_tokens)
    return verdicts


def model_kernels(verdicts: dict[str, KernelVerdict], config: KernelsConfig | None = None) -> ModelKernels:
    """The kernels the model runs, given the verdicts: each fast one that passed, else the reference."""
    config = config or KernelsConfig()
    fast = {name for name, v in verdicts.items() if v.fast}
    chosen: dict = {}
    if "gated_delta_rule" in fast:
        chosen["delta_rule"] = fla.varlen_gated_delta_rule
    if "gdn_decode" in fast:
        from hylora.ops.gdn_decode.triton import gdn_decode

        chosen["gdn_decode"] = gdn_decode
        if config.gdn_decode_launch is not None:
            block_v, num_warps, v_blocks = config.gdn_decode_launch
            chosen["gdn_decode"] = functools.partial(
                gdn_decode, block_v=block_v, num_warps=num_warps, v_blocks=v_blocks
            )
    if "paged_decode_attention" in fast:
        from hylora.ops.paged_decode_attention.triton import paged_decode_attention

        chosen["decode_attention"] = functools.partial(paged_decode_attention, **config.decode_attention_args())
    if "causal_conv1d" in fast:
        from hylora.ops.causal_conv1d.triton import causal_conv1d_by_slot

        chosen["conv"] = causal_conv1d_by_slot
    if "save_conv_states" in fast:
        from hylora.ops.causal_conv1d.triton import save_conv_states

        chosen["save_conv_states"] = save_conv_states
    if "gdn_recurrent" in fast:
        from hylora.ops.gated_delta_rule.triton import recurrent_by_slot

        chosen["gdn_recurrent"] = recurrent_by_slot
    if "prefill_attention" in fast:
        from hylora.ops.attention.flash import paged_attention

        chosen["prefill_attention"] = paged_attention
    if "rms_norm" in fast:
        from hylora.ops.rmsnorm import triton as norm_kernels

        chosen["rms_norm"], chosen["gated_rms_norm"] = norm_kernels.rms_norm, norm_kernels.gated_rms_norm
    if "silu_mul" in fast:
        from hylora.ops.silu_mul.triton import silu_mul

        chosen["silu_mul"] = silu_mul
    if "output_gate" in fast:
        from hylora.ops.output_gate.triton import output_gate

        chosen["output_gate"] = output_gate
    if "logits_scan" in fast:
        from hylora.ops.logits_scan.triton import scan_logits

        chosen["logits_scan"] = scan_logits
    if "tower_rotary" in fast:
        from hylora.ops.rotary.triton import rotate_half

        chosen["tower_rotary"] = rotate_half
    if "tower_attention" in fast:
        chosen["tower_attention"] = verdicts["tower_attention"].implementation
    if "silu_mul_quantized" in verdicts:  # FP8 down projections: their input quantised by the activation
        module = "triton" if "silu_mul_quantized" in fast else "reference"
        chosen["silu_mul_quantized"] = importlib.import_module(f"hylora.ops.silu_mul.{module}").silu_mul_quantized
    if "output_gate_quantized" in verdicts:  # FP8 o_proj: its input quantised by the attention's output gate
        module = "triton" if "output_gate_quantized" in fast else "reference"
        gates = importlib.import_module(f"hylora.ops.output_gate.{module}")
        chosen["output_gate_quantized"] = gates.output_gate_quantized
    if "rms_norm_quantized" in verdicts:  # FP8 projections behind a norm: their input quantised by it
        module = "triton" if "rms_norm_quantized" in fast else "reference"
        norms = importlib.import_module(f"hylora.ops.rmsnorm.{module}")
        chosen["rms_norm_quantized"] = norms.rms_norm_quantized
        chosen["gated_rms_norm_quantized"] = norms.gated_rms_norm_quantized
    if "silu_mul_lora" in fast:  # the Triton LoRA's gate_up expand in the activation (model/kernels.py)
        from hylora.ops.silu_mul.triton import silu_mul_lora

        chosen["silu_mul_lora"] = silu_mul_lora
        chosen["silu_mul_lora_quantizes"] = config.fused_lora_expand_quantized
    if "fp8_linear" in fast:
        kernel = FP8_MODULES.get(verdicts["fp8_linear"].implementation, "triton")
    else:
        kernel = "reference"
    fp8_ops = importlib.import_module(f"hylora.ops.fp8_linear.{kernel}")
    if config.fp8_activations != "dynamic" or kernel != "reference":  # the reference's dynamic GEMM is the default
        chosen["fp8_linear"] = getattr(fp8_ops, FP8_GEMMS[config.fp8_activations])
    if config.fp8_activations == "split":  # the quantising producers split where the split GEMM takes it
        _split_inputs(chosen, fp8_ops.takes_split_input if kernel in FP8_MODULES.values() else lambda tokens: True)
    if config.lora_backend != "auto":  # forced, for the decoder and the tower alike
        chosen["lora_backend"] = chosen["tower_lora_backend"] = config.lora_backend
    elif "lora" in fast:
        chosen["lora_backend"] = "triton"
    if chosen.get("lora_backend") == "triton":  # the lora verdict checked the delta-first op too
        chosen["lora_delta_first_from"] = config.lora_delta_first_from
        chosen["lora_stacked_below"] = config.lora_stacked_below
    chosen["gdn_split_single_tokens"] = config.gdn_single_tokens_recurrent
    return ModelKernels(**chosen)


def _split_inputs(chosen: dict, splits: Callable[[int], bool]) -> None:
    """The chosen quantising norms and activation, split for a split FP8 GEMM (`split_inputs`): both
    terms below the token count where the GEMM stops splitting, the plain values from there."""
    defaults = ModelKernels()

    def plain(name: str) -> Callable:
        return chosen.get(name, getattr(defaults, name))

    if "silu_mul_quantized" in chosen:
        chosen["silu_mul_quantized"] = split_inputs.silu_mul(chosen["silu_mul_quantized"], plain("silu_mul"), splits)
    if "output_gate_quantized" in chosen:
        gate = chosen["output_gate_quantized"]
        chosen["output_gate_quantized"] = split_inputs.output_gate(gate, plain("output_gate"), splits)
    if "rms_norm_quantized" in chosen:
        norm, gated = chosen["rms_norm_quantized"], chosen["gated_rms_norm_quantized"]
        chosen["rms_norm_quantized"] = split_inputs.rms_norm(norm, plain("rms_norm"), splits)
        chosen["gated_rms_norm_quantized"] = split_inputs.gated_rms_norm(gated, plain("gated_rms_norm"), splits)
    if chosen.get("silu_mul_lora_quantizes"):
        chosen["silu_mul_lora"] = split_inputs.silu_mul_lora(chosen["silu_mul_lora"], splits)


def fast_verdicts(names: list[str]) -> dict[str, KernelVerdict]:
    """Verdicts that pass `names` without checking them (tests and benchmarks that install kernels
    by hand; the engine never does)."""
    return {name: passed(name, IMPLEMENTATION.get(name, "triton"), 0.0, 0.0) for name in names}


def select_tower_attention(model: HybridDecoder, backend: str) -> KernelVerdict:
    """The SDPA backend asked for the vision tower's attention, once it ran the tower's views and agreed
    with fp32 math; an explicit choice that cannot serve stops start-up."""
    assert model.visual is not None
    v, dtype = model.visual.config, model.visual.dtype
    tolerance = TOLERANCE[dtype]
    try:
        error = _timed(
            "tower_attention", backend,
            lambda: checks.tower_attention_error(v.num_heads, v.head_dim, dtype, model.device, backend),
        )  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(
            f"tower_attention {backend}: torch's SDPA cannot run the vision tower's attention here "
            f"({str(e).splitlines()[0]}); choose another backend, or auto"
        ) from e
    if not error <= tolerance:  # also catches NaN
        raise RuntimeError(
            f"tower_attention {backend} disagrees with fp32 math on the vision tower's attention (rel. error "
            f"{error:.2e} > {tolerance:.0e}); choose another backend, or auto"
        )
    return passed("tower_attention", backend, error, tolerance)


def select_gdn_kernel(model: HybridDecoder, backend: str = "auto") -> KernelVerdict:
    """The gated-delta-rule kernel of prefill that passes (fla) or the reference, and why."""
    name = "gated_delta_rule"
    if model.device.type != "cuda" or backend == "reference":
        return reference(name)
    if model.dtype == torch.float32 and backend != "fla":
        return reference(name, "fp32 model: fla's Triton kernels would compute in TF32")
    if not fla.is_available():
        if backend == "fla":
            raise RuntimeError("gdn_backend fla was asked for but fla (fla-core) is not importable")
        return reference(name, "fla not installed")
    c, tolerance = model.config, GDN_TOLERANCE[model.dtype]
    error = _timed(name, "fla", lambda: checks.gated_delta_rule_error(
        c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
        model.dtype, model.device,
    ))  # fmt: skip
    if not error <= tolerance:  # also catches NaN
        message = f"fla's gated delta rule disagrees with the reference (rel. error {error:.2e} > {tolerance:.0e})"
        if backend == "fla":
            raise RuntimeError(message)
        log.error("%s; serving with the reference kernel", message)
        return reference(name, message, error=error, tolerance=tolerance, check_failed=True)
    return passed(name, "fla", error, tolerance)


def select_fp8_kernel(
    model: HybridDecoder, fast_kernels: str = "auto", activations: str = "dynamic", deepgemm: bool = True
) -> KernelVerdict:
    """The FP8 GEMM for the model's FP8 projections, checked against the reference on the model's
    shapes. activations "dynamic" (quantised activations x dequantised weights): cuBLAS's block-scaled
    GEMM for steps of many tokens with hylora's Triton kernel below ("cublas+triton"), else the Triton
    kernel alone; "none" (weight-only: the activations as they are): the Triton kernel, with the
    weight dequantised for cuBLAS's 16-bit GEMM from `cublas.WEIGHT_ONLY_FROM` tokens ("cublas+triton");
    "split" (activations as two e4m3 terms): the Triton kernel below `cublas.SPLIT_BELOW` tokens, the
    weight-only path from there. Dynamic activations with `deepgemm` where DeepGEMM is installed (sm_90):
    its GEMM where cuBLAS's would serve, checked first ("deepgemm+cublas+triton").
    On the CPU, or with fast kernels off, the reference (exact, slow: it dequantises per call); on
    CUDA when no kernel passes, the weights are dequantised."""
    name = "fp8_linear"
    if fast_kernels == "off":
        return reference(name, "fast kernels off")
    if not triton_usable(model.device) or model.device.type != "cuda":
        return reference(name, "no CUDA or no triton")
    dtype, dev, shapes = model.dtype, model.device, checks.fp8_shapes(model)

    def check(kernel_module: str) -> Callable[[], float]:
        def run() -> float:
            kernel = getattr(importlib.import_module(f"hylora.ops.fp8_linear.{kernel_module}"), FP8_GEMMS[activations])
            return max(checks.fp8_linear_error(*s, dtype, dev, kernel=kernel, activations=activations) for s in shapes)

        return run

    if deepgemm and activations == "dynamic":
        from hylora.ops.fp8_linear import deepgemm as deepgemm_module

        deepgemm = deepgemm_module.available()
    else:
        deepgemm = False
    return choose_fp8_gemm(check, lambda: dequantize_linears(model), deepgemm=deepgemm)


def choose_fp8_gemm(
    check: Callable[[str], Callable[[], float]], dequantize: Callable[[], None], deepgemm: bool = False
) -> KernelVerdict:
    """The FP8 GEMM as it will serve first: the `cublas` module (cuBLAS where it takes the step, the
    Triton kernel below and for the other shapes), so a model that cuBLAS serves from 128 tokens never
    compiles Triton's tiles for those sizes just to check them; with `deepgemm` (installed, dynamic
    activations) the `deepgemm` module before it, DeepGEMM where cuBLAS would serve. If that fails, the
    next; after the Triton kernel alone at every size, `dequantize()` (the weights in the model's dtype)."""
    name = "fp8_linear"
    if deepgemm:
        with_deepgemm = _verdict(name, check("deepgemm"), FP8_TOLERANCE, implementation="deepgemm+cublas+triton")
        if not with_deepgemm.check_failed:
            return with_deepgemm
        log.warning("DeepGEMM failed its check (%s): cuBLAS serves the FP8 GEMMs", with_deepgemm.reason)
    with_cublas = _verdict(name, check("cublas"), FP8_TOLERANCE, implementation="cublas+triton")
    if not with_cublas.check_failed:
        return with_cublas
    triton_alone = _verdict(name, check("triton"), FP8_TOLERANCE)
    if not triton_alone.check_failed:
        return triton_alone
    dequantize()
    log.error("FP8 kernel failed its check: the FP8 weights are dequantised")
    return replace(triton_alone, reason=triton_alone.reason + "; weights dequantised")


def select_silu_mul_quantized(model: HybridDecoder, fast_kernels: str = "auto", split: bool = False) -> KernelVerdict:
    """The MLP activation fused with the FP8 down projection's input quantisation (`split`: its two
    e4m3 terms), checked against its reference (which is the unfused silu_mul then quantize_activation
    or its split, as the CPU runs it)."""
    name = "silu_mul_quantized"
    if fast_kernels == "off":
        return reference(name, "fast kernels off")
    if not triton_usable(model.device) or model.device.type != "cuda":
        return reference(name, "no CUDA or no triton")
    c = model.config
    return _verdict(name, lambda: checks.silu_mul_error(c.intermediate_size, model.dtype, model.device, quantized=True,
                                                        split=split), FP8_TOLERANCE)  # fmt: skip


def select_output_gate_quantized(
    model: HybridDecoder, fast_kernels: str = "auto", split: bool = False
) -> KernelVerdict:
    """The attention's output gate fused with the FP8 o_proj's input quantisation (`split`: its two
    e4m3 terms), checked against its reference (the unfused gate then quantize_activation or its split)."""
    name = "output_gate_quantized"
    if fast_kernels == "off":
        return reference(name, "fast kernels off")
    if not triton_usable(model.device) or model.device.type != "cuda":
        return reference(name, "no CUDA or no triton")
    c = model.config
    check = functools.partial(
        checks.output_gate_error, c.num_attention_heads, c.head_dim, c.num_key_value_heads, model.dtype, model.device,
        quantized=True, split=split,
    )  # fmt: skip
    return _verdict(name, check, FP8_TOLERANCE)


def select_silu_mul_lora(
    model: HybridDecoder, fast_kernels: str = "auto", quantized: bool = True, split: bool = False
) -> KernelVerdict:
    """The MLP activation with gate_up's LoRA expand in its launch, plain and (`quantized`: where it will
    serve so) quantised for an FP8 down projection (`split`: as two terms), on both forms of h (a
    shrink's fp32 partials, a decode step's 16-bit h of every slot), checked against the expand then
    the activation."""
    name = "silu_mul_lora"
    if fast_kernels == "off":
        return reference(name, "fast kernels off")
    if not triton_usable(model.device) or model.device.type != "cuda":
        return reference(name, "no CUDA or no triton")
    check = functools.partial(
        checks.silu_mul_lora_error,
        model.config.intermediate_size,
        model.dtype,
        model.device,
        quantized=quantized,
        split=split,
    )
    return _verdict(name, check, TOLERANCE[model.dtype])


def select_rms_norm_quantized(model: HybridDecoder, fast_kernels: str = "auto", split: bool = False) -> KernelVerdict:
    """The decoder's norms fused with the input quantisation of the FP8 projection behind them (the
    mixer's in_proj / qkv and the MLP's gate_up behind the hidden norms, the GDN out_proj behind its
    gated norm; `split`: as two e4m3 terms), checked against each norm then quantize_activation (or
    its split)."""
    name = "rms_norm_quantized"
    if fast_kernels == "off":
        return reference(name, "fast kernels off")
    if not triton_usable(model.device) or model.device.type != "cuda":
        return reference(name, "no CUDA or no triton")
    c, dtype, dev = model.config, model.dtype, model.device
    heads = (c.linear_num_value_heads, c.linear_value_head_dim)
    check = functools.partial(
        checks.rms_norm_quantized_error, c.hidden_size, c.rms_norm_eps, dtype, dev, heads=heads, split=split
    )
    return _verdict(name, check, FP8_TOLERANCE)


def select_fast_kernels(
    model: HybridDecoder, page_size: int, config: KernelsConfig | None = None
) -> dict[str, KernelVerdict]:
    """The verdict of each of FAST_KERNELS on this model's shapes."""
    launch = (config or KernelsConfig()).gdn_decode_launch
    gdn_launch = dict(zip(("block_v", "num_warps", "v_blocks"), launch, strict=True)) if launch else {}
    if not triton_usable(model.device) or model.device.type != "cuda":
        return {name: reference(name, "no CUDA or no triton") for name in FAST_KERNELS}
    c, dev, dtype = model.config, model.device, model.dtype
    errors = {
        "gdn_decode": lambda: checks.gdn_decode_error(
            c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim, dtype, dev, **gdn_launch,
        ),
        "paged_decode_attention": lambda: checks.paged_decode_attention_error(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, page_size, dtype, dev,
            **(config or KernelsConfig()).decode_attention_args(),
        ),
        "lora": lambda: max(
            error
            for in_f, rows in checks.lora_shapes(model)
            for rank in checks.LORA_RANKS
            for error in (
                checks.lora_error(in_f, rows, rank, dtype, dev),
                checks.lora_error(
                    in_f, rows, rank, dtype, dev, tokens=checks.STACKED_TOKENS, kernel=checks.stacked_lora_apply
                ),
                checks.lora_error(
                    in_f, rows, rank, dtype, dev, tokens=checks.DELTA_FIRST_TOKENS, kernel=checks.delta_first_lora_apply
                ),
            )
        ),
        "rms_norm": lambda: checks.rms_norm_error(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.linear_num_value_heads,
            c.linear_value_head_dim, c.rms_norm_eps, dtype, dev, rotary_dim=c.rotary_dim,
        ),
        "silu_mul": lambda: checks.silu_mul_error(c.intermediate_size, dtype, dev),
        "output_gate": lambda: checks.output_gate_error(c.num_attention_heads, c.head_dim, c.num_key_value_heads,
                                                        dtype, dev),  # fmt: skip
        "logits_scan": lambda: checks.logits_scan_error(c.vocab_size, dev),
        "causal_conv1d": lambda: checks.causal_conv1d_error(c.linear_conv_dim, c.linear_conv_kernel_dim, dtype, dev),
        "save_conv_states": lambda: checks.save_conv_states_error(
            c.linear_conv_dim, c.linear_conv_kernel_dim, dtype, dev
        ),
        "gdn_recurrent": lambda: checks.gdn_recurrent_error(
            c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, dtype, dev
        ),
        "prefill_attention": lambda: checks.prefill_attention_error(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, page_size, dtype, dev
        ),
    }  # fmt: skip
    if model.visual is not None:
        v = model.visual.config
        errors["tower_rotary"] = lambda: checks.tower_rotary_error(v.num_heads, v.head_dim, model.visual.dtype, dev)
    if dtype not in (torch.float16, torch.bfloat16):  # not a failure: nothing to check
        del errors["prefill_attention"]
    verdicts = {name: _verdict(name, run, TOLERANCE[dtype]) for name, run in errors.items()}
    verdicts.setdefault("tower_rotary", reference("tower_rotary", "no vision tower"))
    verdicts.setdefault(
        "prefill_attention", reference("prefill_attention", "fp32 model: FlashAttention takes fp16 and bf16")
    )
    return verdicts


def _verdict(name: str, run: Callable[[], float], tolerance: float, implementation: str = "") -> KernelVerdict:
    implementation = implementation or IMPLEMENTATION.get(name, "triton")
    try:
        error = _timed(name, implementation, run)
    except Exception as e:  # a kernel that does not compile or launch here is not used
        log.error("%s %s kernel failed to run (%s); serving with the reference", name, implementation, e)
        return reference(name, f"{name} kernel failed: {e}", tolerance=tolerance, check_failed=True)
    if not error <= tolerance:  # also catches NaN
        log.error("%s %s kernel disagrees with the reference (rel. error %.2e)", name, implementation, error)
        reason = f"rel. error {error:.2e} > {tolerance:.0e}"
        return reference(name, reason, error=error, tolerance=tolerance, check_failed=True)
    return passed(name, implementation, error, tolerance)


def _timed(name: str, implementation: str, run: Callable[[], float]) -> float:
    """run(), logged with its time when it took longer than SLOW_CHECK_S."""
    start = time.perf_counter()
    error = run()
    seconds = time.perf_counter() - start
    if seconds > SLOW_CHECK_S:
        log.info("%s %s start-up check took %.1f s (compiling its kernels, or a cold Triton cache)", name,
                 implementation, seconds)  # fmt: skip
    return error
