"""vLLM's Prometheus names on /metrics, labelled by model_name as vLLM's Grafana dashboard queries
them, moving as requests run (issue 24)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server_helpers import running_server

# every series vLLM's published dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# and issue 24 name
SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_sum",
]


@pytest.fixture(scope="module")
def server(demo_cache_dir, tmp_path_factory):
    args = ["--demo", "--max-model-len", "256", "--dtype", "float32", "--device", "cpu"]
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield handle.url


def samples(url: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample on /metrics."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def value(s: dict[str, float], name: str, **labels: str) -> float:
    want = {"model_name": "hylora-demo"} | labels
    total = 0.0
    for key, v in s.items():
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(found.get(k) == w for k, w in want.items()):
            total += v
    return total


def test_vllm_names_are_present_with_model_name_and_move(server):
    before = samples(server)
    body = {"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for model in ("hylora-demo", "relic", "tomb"):
        assert httpx.post(f"{server}/v1/chat/completions", json=body | {"model": model}, timeout=60).status_code == 200
    after = samples(server)
    for name in SERIES:
        assert any(k.startswith(name + "{") and 'model_name="hylora-demo"' in k for k in after), name
    assert value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") == 18
    assert value(after, "vllm:prompt_tokens_total") > value(before, "vllm:prompt_tokens_total")
    finished = value(after, "vllm:request_success_total", finished_reason="length")
    assert finished - value(before, "vllm:request_success_total", finished_reason="length") == 3
    assert (
        value(after, "vllm:e2e_request_latency_seconds_count") - value(before, "vllm:e2e_request_latency_seconds_count")
        == 3
    )
    assert value(after, "vllm:num_requests_running") == 0
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    lora = [k for k in after if k.startswith("vllm:lora_requests_info{")]
    assert lora and 'max_lora="' in lora[0]
