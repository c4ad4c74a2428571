"""Engine configuration: every engine knob in one place (set by `hylora serve` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hylora.env import allow_long_max_model_len
from hylora.kernels.config import KernelsConfig

QUANTIZATIONS = (None, "fp8", "dequantized", "fp8-dequantized")
# max_model_len AUTO (vLLM's `--max-model-len auto` / -1): the model's context, shortened to what the memory holds
AUTO = -1


@dataclass
class EngineConfig:
    max_model_len: int = 8192  # prompt + generated tokens per request (AUTO: the model's context, as memory allows)
    max_num_seqs: int = 32  # running sequences (each holds one GDN state slot)
    # tokens per step (long prompts are chunked to fit); None: 8192 on CUDA (vLLM's serving default:
    # larger prefill steps keep the GPU busy), 2048 on the CPU
    max_num_batched_tokens: int | None = None
    page_size: int = 16  # KV tokens per page
    num_pages: int | None = None  # None: from the memory budget (GPU) or max_num_seqs * max_model_len (CPU)
    gpu_memory_utilization: float = 0.90  # fraction of the GPU hylora may use
    max_loras: int = 4  # device slots for adapters = distinct adapters in flight
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    dtype: str = "auto"
    # weights: None serves an FP8 checkpoint with FP8 GEMMs where the device has them (dequantised
    # elsewhere); "fp8" serves FP8 weights everywhere (the CPU then runs the exact reference GEMM) and
    # quantises an unquantised checkpoint at load, as `hylora quantize` would write it; "dequantized"
    # loads an FP8 checkpoint's weights dequantised; "fp8-dequantized" the values "fp8" would serve,
    # dequantised (an unquantised checkpoint quantised at load, then dequantised: doctor's reference)
    quantization: str | None = None
    device: str | None = None  # None: cuda if available else cpu
    # text only (vLLM's --language-model-only): a VL checkpoint's vision tower is not loaded (~0.9 GB at the
    # 27B shape) and requests with images or videos are refused
    language_model_only: bool = False
    # vLLM's --hf-overrides: merged over the checkpoint's config.json (e.g. YaRN rope_parameters for contexts past
    # 262144 tokens, as Qwen's model cards give them)
    hf_overrides: dict | None = None
    # vision: tower output tokens encoded per step (an image, or one temporal patch of a video, must fit)
    max_num_encoder_tokens: int = 16384
    encoder_cache_gb: float = 1.0  # tower outputs kept by media content (the same video for several adapters)
    # a chunk that encodes part of a video also encodes that video's later temporal patches, as far as
    # the step's encoder budget goes: fewer, larger tower calls (vLLM encodes each item whole). One video
    # of 20 720p frames on an H200 (BASELINE run 25 d): 119 ms in one call, 165 ms in ten
    encode_media_ahead: bool = True
    enforce_eager: bool = False  # no CUDA graphs for decode steps (vLLM's name); the CPU always runs eagerly
    # decode ahead: queue the next decode step before reading this one's tokens, so the host's work
    # overlaps the device's (vLLM's --async-scheduling); decode steps need the padded decode step (CUDA)
    async_scheduling: bool = True
    # with async_scheduling, also the steps after steps with prompt chunks, or that admit waiting
    # requests: the scheduler plans them before the step in flight is read (engine/plan_ahead.py)
    plan_prefill_ahead: bool = True
    seed: int | None = None  # seeds requests that bring none, in arrival order (vLLM's --seed); None = random
    kernels: KernelsConfig = field(default_factory=KernelsConfig)  # which fast kernels may serve
    # steps of at most this many tokens (decode rows with a prompt's last tokens, speculative verify
    # steps) replay CUDA graphs per token bucket (engine/short_step.py); 0: they run eagerly. 256 takes
    # the last step of a prefill burst at 2048 tokens a step (31 decode rows + a 106-token tail in
    # DESIGN.md's workload, run 41). On the CPU only with padded_decode (the graphs' eager twin)
    max_short_step_tokens: int = 256
    # decode and short steps padded as CUDA graphs pad them, run eagerly (the CPU tests drive decode ahead this way)
    padded_decode: bool = False
    # prefix caching (engine/prefix_cache.py): reuse the KV pages and GDN states of cached prompt prefixes
    enable_prefix_caching: bool = True
    # GDN state snapshots the prefix cache may keep (each one sequence's state); None: max(4, max_num_seqs // 2)
    prefix_cache_states: int | None = None
    # MTP speculative decoding (engine/speculative.py): drafts verified per step; 0 = off
    num_speculative_tokens: int = 0
    # a step of verify chunks queues the next drafts behind its acceptance (the device drafts while the
    # host reads the step); False: drafting starts once the step is read (needs the padded drafting step)
    queue_drafts: bool = True
    # testing aid: a request may ask to fault in its next step (engine/faults.py); never on in production
    fault_injection: bool = False

    def __post_init__(self) -> None:
        step_tokens = self.max_num_batched_tokens
        checks = [
            (self.max_model_len >= 1 or self.max_model_len == AUTO, "max_model_len must be >= 1 (or auto)"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (step_tokens is None or step_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_loras >= 1 and self.max_lora_rank >= 1, "max_loras and max_lora_rank must be >= 1"),
            (
                self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): every adapter on "
                "the device keeps its weights in host memory too",
            ),
            (self.max_num_encoder_tokens >= 1, "max_num_encoder_tokens must be >= 1"),
            (self.encoder_cache_gb >= 0, "encoder_cache_gb must be >= 0"),
            (self.prefix_cache_states is None or self.prefix_cache_states >= 0, "prefix_cache_states must be >= 0"),
            (0 <= self.num_speculative_tokens <= 4, "num_speculative_tokens must be in [0, 4]"),
            (self.max_short_step_tokens >= 0, "max_short_step_tokens must be >= 0"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.device is not None:
            _check_device(self.device)

    @property
    def encoder_cache_bytes(self) -> int:
        return int(self.encoder_cache_gb * (1 << 30))

    def check_context(self, max_position_embeddings: int, source: str = "config.json") -> None:
        """max_model_len within the model's trained context (vLLM's rule, and its escape hatch)."""
        if self.max_model_len <= max_position_embeddings or allow_long_max_model_len():  # AUTO too
            return
        raise ValueError(
            f"max_model_len {self.max_model_len} is more than the model's max_position_embeddings "
            f"({max_position_embeddings}, {source}): positions past it were never trained and the output degrades "
            f"without an error; lower --max-model-len to at most {max_position_embeddings}, or set "
            "HYLORA_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to serve it anyway"
        )

    def for_device(self, device: str) -> EngineConfig:
        """This config with the device-dependent defaults filled in."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=8192 if device.startswith("cuda") else 2048)


def _check_device(device: str) -> None:
    """A device this machine has, or a ValueError that says what it has (not torch's assertion)."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}; use cuda or cpu") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA GPU that torch can use; use cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: hylora runs on cuda or cpu")
