"""Sizing the KV pages and GDN state slots: measured on GPU, explicit on CPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.config import EngineConfig
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk

log = logging.getLogger(__name__)
GiB = 1 << 30


class CacheSizeError(ValueError):
    """The caches the configuration asks for do not fit the memory there is (a launch-flag error)."""


@dataclass
class CachePlan:
    num_pages: int
    num_slots: int
    num_snapshots: int = 0  # GDN state snapshots of the prefix cache
    max_model_len: int | None = None  # shorter than asked, to fit (shorten_to_fit); None: as asked


def snapshot_slots(config: EngineConfig) -> int:
    """How many GDN states the prefix cache keeps: one per snapshot point of the prompts it remembers
    (two or three per prompt). A state is a whole sequence's GDN memory (~147 MiB at the 27B shape in
    fp32), so this is a trade against KV pages: by default half a state per running sequence."""
    if not config.enable_prefix_caching:
        return 0
    if config.prefix_cache_states is not None:
        return config.prefix_cache_states
    return max(4, config.max_num_seqs // 2)


def plan_caches(model: HybridDecoder, config: EngineConfig, shorten_to_fit: bool = False) -> CachePlan:
    """The caches for `config`. shorten_to_fit (vLLM's `--max-model-len auto`): where one max_model_len
    sequence (on the CPU: max_num_seqs of them in half the available memory) would not fit, max_model_len
    shortened to what does."""
    slots = config.max_num_seqs * (1 + config.num_speculative_tokens)  # speculation: a state per draft
    snapshots = snapshot_slots(config)
    per_seq_pages = -(-config.max_model_len // config.page_size)
    if model.device.type != "cuda":
        plan = CachePlan(config.num_pages or config.max_num_seqs * per_seq_pages, slots, snapshots)
        available = _host_available_bytes()
        if shorten_to_fit and config.num_pages is None and available is not None:
            states = (slots + snapshots) * _state_bytes_per_slot(model)
            fit = _tokens_that_fit(available // 2 - states, config.max_num_seqs * _page_bytes(model, config.page_size),
                                   config.page_size)  # fmt: skip
            if config.page_size <= fit < config.max_model_len:
                plan = CachePlan(config.max_num_seqs * (fit // config.page_size), slots, snapshots, fit)
        _check_fits(model, config, plan, available, "this machine's available memory")
        return plan
    if config.num_pages is not None:
        # Still one forward at the full token budget: Triton's autotuners (fla's chunked kernels) pick
        # their configurations now, not for seconds inside the first large request.
        activation_peak = _profile_step(model, config)
        plan = CachePlan(config.num_pages, slots, snapshots)
        free = torch.cuda.mem_get_info(model.device)[0] - activation_peak
        _check_fits(model, config, plan, free, "the GPU's free memory after weights and one step's activations")
        return plan

    # GPU: what is left of the budget after weights, LoRA slots and one profiled step.
    dev = model.device
    torch.cuda.synchronize(dev)
    # Give back blocks the caching allocator holds but nothing uses (the weights' first homes, which
    # Linear.stack_lora_a replaced): mem_get_info counts them as used, which would cost KV pages.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    used_before = total - free
    activation_peak = _profile_step(model, config)
    # the tower runs before a step's forward (their activations do not coexist); its outputs stay in the
    # encoder cache, on the device
    tower_peak = _profile_tower(model, config)
    encoder_cache = config.encoder_cache_bytes if model.visual is not None else 0
    budget = total * config.gpu_memory_utilization - used_before - max(activation_peak, tower_peak) - encoder_cache
    state_bytes = _state_bytes_per_slot(model)
    page_bytes = _page_bytes(model, config.page_size)
    max_model_len = None  # as asked
    one_sequence_fits = budget >= (slots + snapshots) * state_bytes + per_seq_pages * page_bytes
    if not one_sequence_fits and shorten_to_fit:
        fit = _tokens_that_fit(budget - (slots + snapshots) * state_bytes, page_bytes, config.page_size)
        max_model_len = fit if config.page_size <= fit < config.max_model_len else None
    if not one_sequence_fits and max_model_len is None:
        raise CacheSizeError(
            f"after weights ({used_before / GiB:.1f} GiB in use), activations ({activation_peak / GiB:.1f} GiB; "
            f"vision tower {tower_peak / GiB:.1f}) and the encoder cache ({encoder_cache / GiB:.1f} GiB) the "
            f"budget ({config.gpu_memory_utilization:.0%} of {total / GiB:.1f} GiB) leaves no room for "
            f"{slots} GDN state slots, {snapshots} prefix-cache states and one {config.max_model_len}-token "
            "sequence; lower --max-num-seqs, --prefix-cache-states, --max-model-len, --max-num-batched-tokens, "
            "--max-num-encoder-tokens or --encoder-cache-gb, or raise --gpu-memory-utilization"
        )
    if page_bytes == 0:  # no attention layer (a model cut to its first GDN layers): pages hold nothing
        num_pages = config.max_num_seqs * per_seq_pages
    else:
        num_pages = int((budget - (slots + snapshots) * state_bytes) // page_bytes)
    log.info(
        "memory: %.1f GiB in use before caches, %.2f GiB activations (vision tower %.2f), encoder cache %.2f GiB, "
        "GDN state %d slots + %d prefix-cache snapshots x %.1f MiB = %.2f GiB, KV %d pages x %d tokens = %.2f GiB",
        used_before / GiB,
        activation_peak / GiB,
        tower_peak / GiB,
        encoder_cache / GiB,
        slots,
        snapshots,
        state_bytes / 2**20,
        (slots + snapshots) * state_bytes / GiB,
        num_pages,
        config.page_size,
        num_pages * page_bytes / GiB,
    )
    return CachePlan(num_pages, slots, snapshots, max_model_len)


def _tokens_that_fit(free_bytes: float, page_bytes: int, page_size: int) -> int:
    """Whole pages' tokens that `free_bytes` holds at `page_bytes` a page (0 where none)."""
    if page_bytes <= 0:
        return 1 << 62
    return max(0, int(free_bytes // page_bytes)) * page_size


def _check_fits(model: HybridDecoder, config: EngineConfig, plan: CachePlan, available: int | None, where: str) -> None:
    """Caches asked for explicitly (or sized by max_num_seqs x max_model_len on the CPU) that would not fit:
    a message with their sizes, not the allocator's error (or, on the CPU, the OOM killer mid-serving)."""
    kv = plan.num_pages * _page_bytes(model, config.page_size)
    states = (plan.num_slots + plan.num_snapshots) * _state_bytes_per_slot(model)
    if available is None or kv + states <= available:
        return
    pages = "--num-pages" if config.num_pages is not None else "--max-model-len or --max-num-seqs (or set --num-pages)"
    raise CacheSizeError(
        f"the KV cache ({plan.num_pages} pages x {config.page_size} tokens = {kv / GiB:.2f} GiB) and the GDN states "
        f"({plan.num_slots} slots + {plan.num_snapshots} prefix-cache states = {states / GiB:.2f} GiB) need "
        f"{(kv + states) / GiB:.2f} GiB, more than {where} ({available / GiB:.2f} GiB); lower {pages}"
    )


def _host_available_bytes() -> int | None:
    """MemAvailable (Linux); None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _state_bytes_per_slot(model: HybridDecoder) -> int:
    c = model.config
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * model.dtype.itemsize
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return len(c.gdn_layers) * (conv + recurrent)


def _page_bytes(model: HybridDecoder, page_size: int) -> int:
    c = model.config
    return 2 * len(model.kv_layers) * page_size * c.num_key_value_heads * c.head_dim * model.dtype.itemsize


@torch.inference_mode()
def _profile_step(model: HybridDecoder, config: EngineConfig) -> int:
    """Peak extra memory of one forward at the full token budget (several sequences when the budget
    exceeds max_model_len, as a step of many prompts has)."""
    n = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    full, rest = divmod(n, config.max_model_len)
    lens = [config.max_model_len] * full + ([rest] if rest else [])
    pages = [-(-m // config.page_size) for m in lens]
    kv = PagedKVCache(model.config, sum(pages), config.page_size, model.dtype, model.device, model.kv_layers)
    states = StatePool(model.config, len(lens), model.dtype, model.device)
    chunks = [SequenceChunk([0] * m, 0, states.allocate(), kv.allocate(p)) for m, p in zip(lens, pages, strict=True)]
    batch = ForwardBatch.build(chunks, config.page_size, model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    base = torch.cuda.memory_allocated(model.device)
    model.logits(model(batch, kv, states)[-1:])
    peak = torch.cuda.max_memory_allocated(model.device) - base
    del kv, states, batch
    torch.cuda.empty_cache()
    return int(peak)


PROFILE_FRAME = 32  # patches a side of the tower profile's frames: 1024 rows, short attention segments


@torch.inference_mode()
def _profile_tower(model: HybridDecoder, config: EngineConfig) -> int:
    """Peak extra memory of a vision-tower call at a step's whole encoder budget, its float32 pixel rows
    included as the engine hands them over (0 without a tower). Frames of 32 x 32 patches: the
    activations grow with the rows, not with how they split into frames (attention is fused)."""
    tower = model.visual
    if tower is None:
        return 0
    c = tower.config
    rows_per_frame = PROFILE_FRAME * PROFILE_FRAME
    frames = -(-config.max_num_encoder_tokens * c.merge_unit // rows_per_frame)
    torch.cuda.reset_peak_memory_stats(model.device)
    base = torch.cuda.memory_allocated(model.device)
    pixels = torch.zeros(frames * rows_per_frame, c.patch_dim, device=model.device)
    tower(pixels, torch.tensor([(frames, PROFILE_FRAME, PROFILE_FRAME)]))
    peak = torch.cuda.max_memory_allocated(model.device) - base
    del pixels
    torch.cuda.empty_cache()
    return int(peak)
