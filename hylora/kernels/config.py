"""The kernel floor's knobs (one dataclass, set by `hylora serve` flags; part of EngineConfig)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from hylora.config import ModelConfig
from hylora.env import triton_interpreter
from hylora.model.layers import LORA_BACKENDS, STACKED_LORA_BELOW

log = logging.getLogger(__name__)
FAST_KERNEL_CHOICES = ("auto", "off")
GDN_BACKENDS = ("auto", "reference", "fla")
FP8_ACTIVATIONS = ("dynamic", "split", "none")
# each fp8_activations setting's GEMM, by its name in the hylora.ops.fp8_linear modules
FP8_GEMMS = {"dynamic": "fp8_linear", "split": "fp8_split_linear", "none": "fp8_weight_only_linear"}
TOWER_ATTENTION = ("auto", "flash", "cudnn", "efficient", "math")


@dataclass(frozen=True)
class KernelsConfig:
    # auto: each fast kernel serves once it passed its start-up check; off: the torch references
    # (the GDN prefill kernel has gdn_backend)
    fast_kernels: str = "auto"
    # the chunked gated delta rule of prefill. auto: fla for 16-bit models when it passes its check
    # (fp32 models keep the exact reference: fla computes in TF32); fla: required, or start-up fails
    gdn_backend: str = "auto"
    # LoRA arithmetic in every linear. auto: hylora's Triton kernels once they passed their check,
    # else masked on CUDA and grouped on the CPU; grouped / masked / triton force one
    lora_backend: str = "auto"
    # hylora's GDN decode kernel's launch (block_v, num_warps, v_blocks); None: its defaults (tuned on
    # an H200). Another card: the pick of bench/kernel_sweep_gpu.py --gdn-best-out
    gdn_decode_launch: tuple[int, int, int] | None = None
    # what FP8 projections do with their inputs. dynamic: quantise them per token and 128 inputs, as the
    # checkpoints' activation_scheme says (FP8 tensor cores); split: below 768 tokens (decode) each input
    # as two e4m3 terms sharing one scale, hi and the rest's lo, two FP8 dots per weight tile (~2^-8 of
    # each value, less than a bf16 rounding in norm; bf16's fidelity, 1.11-1.14x bf16's 64-layer workload
    # on an H100), from 768 tokens as none; none: keep them in the model's dtype and
    # convert the FP8 weights in the GEMM, or dequantise them for cuBLAS from 128 tokens (the
    # dequantised model's arithmetic, FP8 weights in memory; about bf16's speed on an H200, docs/FP8.md)
    fp8_activations: str = "dynamic"
    # dynamic (and split) FP8 activations: the MLP's activation quantises (splits) the down projection's
    # input in its own launch (ops.silu_mul.silu_mul_quantized), rather than the GEMM quantising it in
    # another; the same values either way. False: the separate launches (a same-run comparison,
    # bench/profile_gpu.py). Split: below cublas.SPLIT_BELOW tokens where cuBLAS serves (kernels/split_inputs.py)
    fp8_fused_quant: bool = True
    # dynamic FP8 activations: where DeepGEMM is installed (`import deep_gemm` on an sm_90 GPU; stock
    # vLLM's FP8 GEMM on Hopper) its block-scaled GEMM serves the steps cuBLAS's would, once it passed
    # its start-up check (ops/fp8_linear/deepgemm.py). H100 (BASELINE run 57): level with cuBLAS at 8192
    # tokens, 1.10-1.26x faster at 128-1024. Its kernels compile at first use (2.5-8.7 s each), so with it
    # the start-up compiles them for every step size (kernels/warmup.py; one shape: 61 s, run 58 b). The
    # engine with it (H100, run 59, 16-layer cut, 8192): 1.02x the FP8 workload's tok/s, base and mixed, in
    # two A/B pairs; start-up +~60 s on its first start, +4 s on a warm JIT cache. Doctor passes every check
    # on that deployment (H200, run 60: bench/doctor_gpu.sh fp8-deepgemm). The 27B's first start with it: its
    # 6 weight shapes compile in parallel child processes, 88 s on a cold JIT cache, 7 s warm (H100, run 61 a).
    # On by default since run 62 (H100, beside stock vLLM on one FP8 checkpoint: 1.16x base and 1.41-1.45x
    # mixed at 2048 and 8192; level with cuBLAS at 2048). Where `import deep_gemm` fails (the CPU, other GPUs,
    # no DeepGEMM) it changes nothing. False: cuBLAS / Triton serve those steps, no DeepGEMM compile at start
    fp8_deepgemm: bool = True
    # ... and the decoder's norms quantise the in_proj / qkv's, gate_up's and the GDN out_proj's input
    # (ops.rmsnorm's rms_norm_quantized). On an H200 (BASELINE run 35, same call, 16-layer cut, 8192
    # batched tokens): FP8 workload 4001 -> 4069 tok/s base, 3397 -> 3445 mixed; the kernel alone 1.3x
    # faster than the norm + quantisation (bench/fp8_fusion_gpu.py). Run 34's slower fused norm had the
    # per-element division since replaced (docs/FP8.md)
    fp8_fused_norm_quant: bool = True
    # the Triton LoRA: the MLP's activation applies gate_up's LoRA expand in its own launch
    # (ops.silu_mul.silu_mul_lora), rather than the expand's kernel writing [gate | up] back first; the
    # same arithmetic. False: the expand kernel, then the activation (a same-run comparison)
    fused_lora_expand: bool = True
    # ... also where the activation quantises for an FP8 down projection (dynamic activations). Off by
    # default: on an H200 it gains nothing over the expand kernel then silu_mul_quantized (BASELINE run
    # 35: 9.1 vs 9.0 us at 32 tokens, 682 vs 686 at 8192; the FP8 workload 4071 vs 4069 tok/s base,
    # 3452 vs 3445 mixed), and its start-up check would cost a compile
    fused_lora_expand_quantized: bool = False
    # hylora's Triton LoRA in host steps (prefill) of at least this many tokens: the delta written first
    # by cuBLAS, the base GEMM accumulating onto it (docs/LORA.md); 0: never, shrink + expand always.
    # H200, 8 rank-16 slots, the 27B's linears (BASELINE run 29): 15-43 % less LoRA time than shrink +
    # expand at 8192 tokens and the 8192-token workload's mixed prefill 0.39-0.40 -> 0.38 s (base 0.35);
    # at 2048 the op alone also won (8-43 %), but the 2048-token workload's mixed prefill ran erratic
    # (0.42-0.54 s) with it, not compared against the path without it (bench/lora_prefill_gpu.py does)
    lora_delta_first_from: int = 4096
    # hylora's Triton LoRA in eager steps of fewer tokens than this: the shrink rides in the base GEMM over
    # [W; A of every slot] (Linear.stack_lora_a; h rounded once to the model dtype), one launch less per
    # linear for ~1-3 % more GEMM columns (8 rank-16 slots, the 27B's linears); from it, the shrink kernel
    # (fp32 h). CUDA-graphed steps always stack; an eager step that takes the delta first
    # (lora_delta_first_from) does so whatever this says.
    # 4096 (BASELINE run 43 a, one H200, same warm machine, 16-layer cut, 2048 batched tokens): the 8-mixed
    # workload 2692-2720 -> 2750-2755 tok/s, its prefill 0.371-0.376 -> 0.360-0.362 s, base unchanged,
    # against 128 (run 12's decode-size sweep, where at 64 tokens the GDN in_proj alone ran slower stacked)
    lora_stacked_below: int = STACKED_LORA_BELOW
    # an eager prefill step's leading one-token sequences (the decode rows riding along with prompt
    # chunks) through the token-by-token GDN kernel, in place by state slot, the rest through the chunked
    # kernel: fla pads each one-token sequence to a 64-token chunk and gathers and scatters its fp32
    # state (3 MB a sequence at the 27B shape). BASELINE run 43 a (as above): base 2959-2973 -> 2987-3013
    # tok/s, 8 mixed 2692-2720 -> 2728-2750; its steps with 28-32 decode rows 1-3 ms shorter
    gdn_single_tokens_recurrent: bool = True
    # the vision tower's attention: one of torch's SDPA backends (flash, cudnn, efficient, math), checked
    # at start-up against fp32 math on the tower's strided q/k/v views (start-up fails if it cannot run
    # them); auto: torch's own pick. Attention was 47.5 of the 119 ms of a 720p video's tower call on an
    # H200 (BASELINE run 25 d), ~3x its FLOP floor; bench/tower_gpu.py times each backend
    tower_attention: str = "auto"
    # decode attention over the paged KV cache (ops.paged_decode_attention) with a 16-bit cache: P @ V with
    # p rounded to the cache's dtype (one 16-bit MMA, as FlashAttention does) or, False, p in fp32 against V
    # upcast (tf32x3, exact products); and the tokens each step of a program's loop reads (BLOCK_T: 16, 32
    # or 64). H200, docs/BASELINE.md run 46: the kernel 1.5-1.7x faster with both (True, 32) than with
    # (False, 16), at 1.15-1.67x its KV read; the video workload 408 -> 431-435 out tok/s, TPOT p50
    # 29.5 -> 26.4 ms. bench/kernel_sweep_gpu.py --only attention times the candidates
    decode_attention_pv_16bit: bool = True
    decode_attention_block_t: int = 32

    def decode_attention_args(self) -> dict[str, int | bool]:
        """The decode attention kernel's arguments these switches set."""
        return {"pv_16bit": self.decode_attention_pv_16bit, "block_t": self.decode_attention_block_t}

    def __post_init__(self) -> None:
        launch = self.gdn_decode_launch
        if launch is not None and (
            len(launch) != 3 or any(not isinstance(v, int) or v < low for v, low in zip(launch, (1, 1, 0), strict=True))
        ):
            raise ValueError(f"gdn_decode_launch must be block_v, num_warps >= 1 and v_blocks >= 0, got {launch!r}")
        if self.decode_attention_block_t not in (16, 32, 64):
            raise ValueError(f"decode_attention_block_t must be 16, 32 or 64, got {self.decode_attention_block_t!r}")
        for name in ("lora_delta_first_from", "lora_stacked_below"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: never), got {value}")
        for name, allowed in (
            ("fast_kernels", FAST_KERNEL_CHOICES),
            ("gdn_backend", GDN_BACKENDS),
            ("lora_backend", ("auto", *LORA_BACKENDS)),
            ("fp8_activations", FP8_ACTIVATIONS),
            ("tower_attention", TOWER_ATTENTION),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


def parse_kernel_overrides(text: str) -> dict[str, int | str]:
    """`name=value,...` for KernelsConfig's boolean (0 or 1), integer and string fields, checked by
    KernelsConfig itself (ValueError names what to fix). `hylora serve --kernels` and the benches take it."""
    kinds = {f.name: {bool: "bool", int: "int", str: "str"}.get(f.type, f.type) for f in fields(KernelsConfig)}
    kinds = {name: kind for name, kind in kinds.items() if kind in ("bool", "int", "str")}
    out: dict[str, int | str] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        kind = kinds.get(name)
        if kind == "str" and value:
            out[name] = value
            continue
        if kind is None or not value.isdigit() or (kind == "bool" and value not in ("0", "1")):
            raise ValueError(f"{item!r}: want name=0|1, name=N or name=text, name one of {', '.join(sorted(kinds))}")
        out[name] = (value == "1") if kind == "bool" else int(value)
    KernelsConfig(**out)  # type: ignore[arg-type]
    return out


def kernel_overrides_arg(text: str) -> dict[str, int | str]:
    """`parse_kernel_overrides` as an argparse type (`--kernels` of hylora serve and doctor)."""
    try:
        return parse_kernel_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kernels_with_overrides(flags: dict[str, Any], overrides: dict[str, int | str]) -> KernelsConfig:
    """KernelsConfig from a command's kernel flags (field name → value), then its `--kernels` overrides
    (`parse_kernel_overrides`); a field a flag set to other than its default and `--kernels` to another
    value is a ValueError that names both."""
    values = dict(flags)
    for name, value in overrides.items():
        if name in values and values[name] not in (value, KernelsConfig.__dataclass_fields__[name].default):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} {values[name]} and --kernels {name}={value} disagree: give one")
        values[name] = value
    return KernelsConfig(**values)


def kernel_switches(kernels: dict[str, int | str]) -> str:
    """`parse_kernel_overrides`' input for these values (booleans as 0 / 1)."""
    return ",".join(f"{k}={v if isinstance(v, str) else int(v)}" for k, v in kernels.items())


def triton_usable(device: torch.device | str) -> bool:
    """Triton importable and able to run here: a CUDA device, or Triton's CPU interpreter
    (TRITON_INTERPRET=1, Triton's own switch: the tests run the kernels' logic that way)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if torch.device(device).type == "cuda":
        return True
    return torch.device(device).type == "cpu" and triton_interpreter()


def fp8_unusable(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why FP8 weights cannot be served with FP8 GEMMs here (None: they can): e4m3 tensor cores
    (compute capability 8.9 or newer) and Triton, for a 16-bit model (an fp32 model is a reference:
    it computes with the dequantised weights)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if dtype == torch.float32:
        return "an fp32 model computes with the dequantised weights"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9+ has)"
    if not triton_usable(device):
        return "triton is not installed"
    return None


def serve_fp8(
    model: ModelConfig, quantization: str | None, device: torch.device | str, dtype: torch.dtype | None
) -> bool:
    """Whether the engine serves FP8 weights. quantization "fp8": always (an unquantised checkpoint is
    quantised at load, as vLLM's --quantization fp8 does); "dequantized", "fp8-dequantized": never; None: an FP8
    checkpoint where the device runs FP8 GEMMs (fp8_unusable), else its weights are dequantised."""
    if quantization in ("fp8", "dequantized", "fp8-dequantized"):
        return quantization == "fp8"
    if model.quantization is None:
        return False
    why = fp8_unusable(device, dtype or model.checkpoint_dtype)
    if why:
        log.info("FP8 checkpoint: weights dequantised at load (%s)", why)
    return why is None


def parse_launch(text: str) -> tuple[int, int, int]:
    """`block_v,num_warps[,v_blocks]` (v_blocks defaults to 1; 0: the split form) as gdn_decode_launch."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"expected block_v,num_warps[,v_blocks] (integers), got {text!r}") from None
    if len(values) not in (2, 3):
        raise ValueError(f"expected block_v,num_warps[,v_blocks], got {text!r}")
    return tuple((values + [1])[:3])  # type: ignore[return-value]
