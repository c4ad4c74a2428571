"""Prometheus metrics: request outcomes and latency per adapter, and the engine's resources,
including adapter residency (what an adapter-aware router needs).

An adapter's series go once it is unloaded and nothing of it runs or waits (at the next scrape):
with runtime loading, names come and go, and series kept for every name ever served made a scrape
grow without bound (4,000 load / request / unload cycles: 17 MB and 1.1 s a scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from hylora.engine.stats import EngineStats
from hylora.media.cache import ProcessedCache

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "hylora_requests",
            "Finished requests by outcome (stop, length, abort, error) and adapter ('' = base)",
            ["status", "adapter"],
            registry=r,
        )
        self.rejected = Counter(
            "hylora_rejected_requests", "Requests refused before running, by HTTP status", ["code"], registry=r
        )
        self.slow_readers = Counter(
            "hylora_slow_reader_cuts", "Streams cut because the client stopped reading", registry=r
        )
        self.prompt_tokens = Counter("hylora_prompt_tokens", "Prompt tokens processed", ["adapter"], registry=r)
        self.generation_tokens = Counter("hylora_generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = Histogram(
            "hylora_time_to_first_token_seconds",
            "Arrival to first generated token",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.intake = Histogram(
            "hylora_request_intake_seconds",
            "Arrival to engine admission by phase: read (body received, parsed, validated), prepare (prompt "
            "and media: fetched, decoded, preprocessed), admit (the engine thread took it, between two steps)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "hylora_inter_token_latency_seconds",
            "Time between generated tokens",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        g = {
            "queue": ("hylora_waiting_requests", "Requests waiting to be scheduled"),
            "running": ("hylora_running_requests", "Requests running"),
            "kv_used": ("hylora_kv_pages_used", "KV-cache pages in use"),
            "kv_total": ("hylora_kv_pages_total", "KV-cache pages"),
            "slots_used": ("hylora_state_slots_used", "GDN state slots in use"),
            "slots_total": ("hylora_state_slots_total", "GDN state slots"),
            "lora_slots_used": ("hylora_lora_slots_used", "Device LoRA slots holding an adapter"),
            "lora_slots_total": ("hylora_lora_slots_total", "Device LoRA slots (max_loras)"),
            "adapters_loaded": ("hylora_adapters_loaded", "Adapters registered by name"),
            "adapters_on_cpu": ("hylora_adapters_on_cpu", "Adapters in the CPU cache"),
            "encoder_hits": ("hylora_encoder_cache_hits", "Media segments served from the encoder cache (cumulative)"),
            "encoder_misses": ("hylora_encoder_cache_misses", "Media segments the vision tower encoded (cumulative)"),
            "encoder_bytes": ("hylora_encoder_cache_bytes", "Bytes of vision-tower outputs in the encoder cache"),
            "encoder_entries": ("hylora_encoder_cache_entries", "Media segments in the encoder cache"),
            "engine_steps": ("hylora_engine_steps", "Engine steps run (cumulative)"),
            "prefix_cache_entries": ("hylora_prefix_cache_entries", "Prompt prefixes in the prefix cache"),
            "steps_ahead": (
                "hylora_decode_steps_ahead",
                "Decode steps queued before the step before them was read (async scheduling; cumulative)",
            ),
            "prefill_steps_ahead": (
                "hylora_prefill_steps_ahead",
                "Steps with prompt chunks or admissions planned before the step before them was read (cumulative)",
            ),
            "step_seconds": (
                "hylora_engine_step_seconds",
                "Host seconds the engine thread spent in steps (cumulative; its rate is how busy that thread is)",
            ),
            "add_seconds": ("hylora_engine_add_seconds", "Host seconds the engine thread spent admitting requests"),
        }
        self.gauges = {key: Gauge(name, doc, registry=r) for key, (name, doc) in g.items()}
        media = {
            "hits": "Images / videos served preprocessed: from the cache or another request's work (cumulative)",
            "misses": "Images / videos decoded and preprocessed, or tried (cumulative)",
            "bytes": "Bytes of pixel rows in the preprocessed-media cache",
            "entries": "Images / videos in the preprocessed-media cache",
        }
        self.media_gauges = {key: Gauge(f"hylora_media_cache_{key}", doc, registry=r) for key, doc in media.items()}
        self.adapter_on_device = Gauge(
            "hylora_adapter_on_device", "1 if the adapter holds a device slot", ["adapter"], registry=r
        )
        self.adapter_running = Gauge(
            "hylora_adapter_running_requests", "Running requests per adapter", ["adapter"], registry=r
        )
        self.adapter_waiting = Gauge(
            "hylora_adapter_waiting_requests", "Waiting requests per adapter", ["adapter"], registry=r
        )
        self.prefix_hits = Gauge(
            "hylora_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache per adapter (cumulative; hit rate = hits / queried)",
            ["adapter"],
            registry=r,
        )
        self.prefix_queries = Gauge(
            "hylora_prefix_cache_queried_tokens",
            "Prompt tokens looked up per adapter (cumulative)",
            ["adapter"],
            registry=r,
        )

    def render(self, stats: EngineStats, media_cache: ProcessedCache | None = None) -> bytes:
        for key, gauge in self.gauges.items():
            gauge.set(getattr(stats, key))
        if media_cache is not None:
            for key, gauge in self.media_gauges.items():
                gauge.set(len(media_cache) if key == "entries" else getattr(media_cache, key))
        live = {"", *stats.on_device, *(a for a, n in stats.running_by_adapter.items() if n)}
        live |= {a for a, n in stats.waiting_by_adapter.items() if n}
        by_adapter = ("adapter",)
        for metric, names in (
            (self.requests, ("status", "adapter")),
            (self.prompt_tokens, by_adapter),
            (self.generation_tokens, by_adapter),
            (self.ttft, by_adapter),
            (self.itl, by_adapter),
        ):
            _drop_adapters(metric, names, live)
        for gauge, values in (
            (self.adapter_on_device, stats.on_device),
            (self.adapter_running, stats.running_by_adapter),
            (self.adapter_waiting, stats.waiting_by_adapter),
            (self.prefix_hits, stats.prefix_hits_by_adapter),
            (self.prefix_queries, stats.prefix_queries_by_adapter),
        ):
            gauge.clear()
            for adapter, value in values.items():
                gauge.labels(adapter=adapter).set(value)
        return generate_latest(self.registry)


def _drop_adapters(metric: MetricWrapperBase, names: tuple[str, ...], live: set[str]) -> None:
    """Remove `metric`'s series (label `names`, in order) whose adapter label is not in `live`."""
    stale = {
        tuple(sample.labels[n] for n in names)
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get("adapter") not in live
    }
    for values in stale:
        metric.remove(*values)
