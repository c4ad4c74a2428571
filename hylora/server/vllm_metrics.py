"""vLLM's Prometheus metrics, by vLLM's names and `model_name` label, beside hylora's own: vLLM's
published Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) and the alerts
teams built on it work unchanged against hylora.

Engine gauges are read at scrape time (`update`); request metrics are observed by the server as
each request's tokens arrive and when it ends. Names, label sets and histogram buckets follow vLLM
0.20's `vllm/v1/metrics/loggers.py`; `vllm:gpu_cache_usage_perc` (the dashboard's) and
`vllm:time_per_output_token_seconds` are kept beside their newer names.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hylora.engine.outputs import RequestOutput
from hylora.engine.stats import EngineStats
from hylora.media.cache import ProcessedCache

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")  # vllm:request_success_total's finished_reason values


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to the context length."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class VLLMMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, max_loras: int):
        self.model_name, self.max_loras = model_name, max_loras
        labels = ["model_name"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"vllm:{name}", doc, [*labels, *extra], registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, labels, buckets=buckets, registry=registry)

        tokens = token_buckets(max_model_len)
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache = gauge("gpu_cache_usage_perc", "KV-cache usage (vLLM's former name). 1 means 100 percent.")
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.mm_queries = counter("mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        self.mm_hits = counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft's position.", ("position",)
        )
        self._seen: dict[str, int] = {}  # engine counters already added (the engine reports totals)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.success = counter("request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS
        )
        self.inference = histogram(
            "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS
        )
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_len = histogram("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_generation = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", tokens
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )

    def update(self, stats: EngineStats, media_cache: ProcessedCache | None = None) -> None:
        """Engine gauges, at scrape time (and the preprocessed-media cache's counters: vLLM's mm cache)."""
        name = self.model_name
        self.running.labels(name).set(stats.running)
        self.waiting.labels(name).set(stats.queue)
        usage = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
        self.kv_usage.labels(name).set(usage)
        self.gpu_cache.labels(name).set(usage)
        for key, counter, total in (
            ("preemptions", self.preemptions, stats.preemptions),
            ("prefix_queries", self.prefix_queries, stats.prefix_cache_queries),
            ("prefix_hits", self.prefix_hits, stats.prefix_cache_hits),
            ("spec_drafts", self.spec_drafts, stats.spec_drafts),
            ("spec_draft_tokens", self.spec_draft_tokens, stats.spec_draft_tokens),
            ("spec_accepted", self.spec_accepted, stats.spec_accepted_tokens),
        ):
            self._add(key, counter.labels(name), total)
        if media_cache is not None:
            self._add("mm_queries", self.mm_queries.labels(name), media_cache.hits + media_cache.misses)
            self._add("mm_hits", self.mm_hits.labels(name), media_cache.hits)
        for pos, total in enumerate(stats.spec_accepted_per_position):
            self._add(f"spec_pos{pos}", self.spec_accepted_per_pos.labels(name, str(pos)), total)
        self.lora_info.clear()
        running = ",".join(sorted(a for a, n in stats.running_by_adapter.items() if a and n))
        waiting = ",".join(sorted(a for a, n in stats.waiting_by_adapter.items() if a and n))
        self.lora_info.labels(str(self.max_loras), waiting, running).set(time.time())

    def _add(self, key: str, counter: Counter, total: int) -> None:
        """Bring `counter` up to the engine's cumulative `total`."""
        seen = self._seen.get(key, 0)
        counter.inc(max(0, total - seen))
        self._seen[key] = max(seen, total)

    def request_started(self, prompt_tokens: int, n: int, max_tokens: int) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.params_n.labels(name).observe(n)
        self.params_max_tokens.labels(name).observe(max_tokens)

    def tokens(self, count: int, since_arrival: float | None, since_last: float | None) -> None:
        """`count` new tokens of one choice: the first (since_arrival: TTFT) or later ones (since_last)."""
        name = self.model_name
        self.generation_tokens.labels(name).inc(count)
        if since_arrival is not None:
            self.ttft.labels(name).observe(since_arrival)
        if since_last is not None:
            for _ in range(count):
                self.itl.labels(name).observe(since_last / count)
                self.tpot.labels(name).observe(since_last / count)

    def choice_finished(self, out: RequestOutput, prompt_tokens: int, since_arrival: float) -> None:
        """One engine request (one choice) ended; only stop / length / abort count as successes."""
        name = self.model_name
        if out.finish_reason not in FINISH_REASONS:
            return
        self.success.labels(name, out.finish_reason).inc()
        self.e2e.labels(name).observe(since_arrival)
        self.prompt_len.labels(name).observe(prompt_tokens)
        self.generation_len.labels(name).observe(out.num_output_tokens)
        t = out.timing
        if t is None or t.scheduled is None:
            return
        self.queue.labels(name).observe(t.scheduled - t.arrival)
        if t.last_token is not None:
            self.inference.labels(name).observe(t.last_token - t.scheduled)
        if t.first_token is not None:
            self.prefill.labels(name).observe(t.first_token - t.scheduled)
            self.decode.labels(name).observe((t.last_token or t.first_token) - t.first_token)

    def choice_aborted(self) -> None:
        """A choice whose client left before it ended (the engine aborted it)."""
        self.success.labels(self.model_name, "abort").inc()

    def job_finished(self, max_tokens: int) -> None:
        """A whole HTTP request ended (`max_tokens`: what it asked for, per choice)."""
        self.max_generation.labels(self.model_name).observe(max_tokens)
