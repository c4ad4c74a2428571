"""What the engine reports about itself (`LLMEngine.stats()`): a snapshot for metrics, read on the
engine thread so the numbers agree with each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    queue: int  # requests waiting to be scheduled
    running: int
    kv_used: int  # KV-cache pages
    kv_total: int
    slots_used: int  # GDN state slots
    slots_total: int
    lora_slots_used: int  # device LoRA slots holding an adapter
    lora_slots_total: int
    adapters_loaded: int
    adapters_on_cpu: int
    encoder_hits: int  # media segments served from the encoder cache (cumulative)
    encoder_misses: int
    encoder_bytes: int
    encoder_entries: int
    engine_steps: int  # cumulative
    steps_ahead: int  # decode steps queued before the step before them was read (cumulative)
    prefill_steps_ahead: int  # other steps the scheduler planned before the step before them was read
    preemptions: int  # requests sent back to the queue to free KV pages (cumulative)
    step_seconds: float = 0.0  # host seconds in step() (cumulative); its rate: how busy the engine thread is
    add_seconds: float = 0.0  # host seconds in add_request() (cumulative)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # prompt tokens served from it (cumulative)
    prefix_cache_entries: int = 0
    prefix_hits_by_adapter: dict[str, int] = field(default_factory=dict)  # "" = base; cumulative tokens
    prefix_queries_by_adapter: dict[str, int] = field(default_factory=dict)
    spec_drafts: int = 0  # speculative verify chunks run (cumulative)
    spec_draft_tokens: int = 0  # drafts verified (cumulative)
    spec_accepted_tokens: int = 0  # drafts accepted (cumulative)
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [k]: draft i accepted (cumulative)
    on_device: dict[str, int] = field(default_factory=dict)  # adapter → 1 if it holds a device slot
    running_by_adapter: dict[str, int] = field(default_factory=dict)  # "" = base
    waiting_by_adapter: dict[str, int] = field(default_factory=dict)
