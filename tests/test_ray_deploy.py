"""hylora on Ray Serve (hylora/deploy): the pieces without Ray, then `hylora serve --demo --replicas 2`
started for real (one Ray instance for the module, CPU replicas): outputs equal the single-process
server's, adapter affinity, load / unload on every replica, a replica killed under load, and the
drain on SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hylora.deploy.affinity import RoutingTable, multiplexed_model_id
from hylora.deploy.catalog import AdapterCatalog, AppliedChanges
from hylora.deploy.forwarding import ForwardedRequest, ResponseHead, call, relay
from hylora.deploy.metrics import ReplicaMetricsBoard
from hylora.deploy.options import ReplicaPlan, parse_config
from hylora.deploy.stream_end import StreamTracker
from hylora.server.errors import APIError
from tests.ray_helpers import Outcome, chat, post, replica_pids
from tests.server_helpers import running_server

MODELS = ["hylora-demo", "relic", "tomb", "mural"]  # the base and the three demo adapters
PROMPTS = ["Describe the relic.", "Where is the entrance?", "What pigments are on the east wall?"]
SERVER_FLAGS = ["--demo", "--max-model-len", "256", "--max-num-seqs", "8", "--max-loras", "4", "--seed", "0"]
EXIT_RAY_UNAVAILABLE = 3


# --- the pieces, without Ray -------------------------------------------------------------------


def test_builder_config_reads_hylora_serve_flags():
    args = parse_config(
        {"demo": "true", "replicas": "2", "lora_modules": "a=/x b=/y", "max-loras": 2, "task": ["t=a"],
         "limit_mm_per_prompt": {"image": 1}, "enforce_eager": False}
    )  # fmt: skip
    assert args.demo and args.replicas == 2 and args.max_loras == 2 and not args.enforce_eager
    assert args.lora_modules == ["a=/x", "b=/y"] and args.task == ["t=a"] and args.limit_mm_per_prompt == {"image": 1}
    assert parse_config({"model_dir": "/models/m"}).model_dir == "/models/m"
    # vLLM's dotted keys of a JSON flag, over the flag given whole, and its sizes
    args = parse_config({"speculative_config": {"method": "mtp"}, "speculative-config.num_speculative_tokens": 2,
                         "limit_mm_per_prompt.video": 0, "max_model_len": "2k"})  # fmt: skip
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.limit_mm_per_prompt == {"video": 0} and args.max_model_len == 2000
    with pytest.raises(ValueError, match="unknown option 'max_lora'"):
        parse_config({"max_lora": 2})


def test_replica_plan_pins_one_gpu_each_where_there_are_gpus():
    args = parse_config({"demo": True, "replicas": 3, "max_loras": 6, "max_num_seqs": 16})
    assert ReplicaPlan.from_args(args, cluster_gpus=8) == ReplicaPlan(3, 1.0, 1.0, 6, 16)
    assert ReplicaPlan.from_args(args, cluster_gpus=0).gpus == 0
    assert ReplicaPlan.from_args(parse_config({"demo": True, "replicas": 2, "device": "cpu"}), 8).gpus == 0
    assert ReplicaPlan.from_args(parse_config({"demo": True, "replicas": 2, "replica_gpus": 0.5}), 8).gpus == 0.5
    with pytest.raises(ValueError, match="--device cuda"):
        ReplicaPlan.from_args(parse_config({"demo": True, "replicas": 2, "device": "cuda"}), 0)


def test_multiplexed_model_id_is_the_adapter_after_task_routing():
    table = RoutingTable("base", {"dig": "relic", "gone": "old"}, {"relic", "tomb"})
    chat_path = "/v1/chat/completions"

    def mid(body: object, header: str | None = None, path: str = chat_path) -> str:
        return multiplexed_model_id(table, path, json.dumps(body).encode(), header)

    assert mid({"model": "tomb"}) == "tomb"
    assert mid({"model": "tomb", "input": "Where?"}, path="/v1/responses") == "tomb"  # the Responses API too
    assert mid({"model": "base"}) == mid({}) == ""  # base model: any replica
    assert mid({"task": "dig"}) == mid({}, header="dig") == "relic"
    assert mid({"task": "dig"}, header="other") == "relic"  # the body's task wins, as in the server
    assert mid({"model": "made-up"}) == mid({"task": "gone"}) == mid({"task": "nope"}) == ""  # never an id
    assert mid({"model": "tomb"}, path="/tokenize") == ""
    assert multiplexed_model_id(table, chat_path, b"not json", None) == ""
    assert multiplexed_model_id(table, "/v1/completions", b'["a list"]', None) == ""


def test_catalog_changes_apply_once_in_order():
    catalog, replica = AdapterCatalog(), AppliedChanges()
    load = catalog.propose("a", "a_dir")
    failed = catalog.propose("b", "bad")  # never committed: the replica that checked it said no
    unload = catalog.propose("a", None)
    catalog.commit(load)
    assert replica.pending(catalog.changes()) == [load]
    replica.mark(load)
    catalog.commit(unload)
    assert catalog.changes() == (unload,) and replica.pending(catalog.changes()) == [unload]
    catalog.commit(load)  # an older change never replaces a newer one
    assert catalog.changes() == (unload,) and failed not in catalog.changes()
    assert unload.route == "/v1/unload_lora_adapter" and unload.payload() == {"lora_name": "a"}
    assert load.payload() == {"lora_name": "a", "lora_path": "a_dir"}


def _toy_app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["x"], "q": request.url.query}, status_code=201)

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def gen():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("closed")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_relay_runs_a_request_through_the_app_and_leaving_early_closes_it():
    events: list[str] = []
    app = _toy_app(events)

    async def scenario() -> None:
        status, body = await call(app, ForwardedRequest.json("/echo", {"x": 7}))
        assert (status, json.loads(body)) == (201, {"got": 7, "q": ""})
        items = []
        async for item in relay(app, ForwardedRequest("GET", "/stream"), [(b"x-hylora-replica", b"r1")]):
            items.append(item)
            if len(items) == 3:
                break  # the ingress cancelled: its client went away
        head = items[0]
        assert isinstance(head, ResponseHead) and head.more and head.header("x-hylora-replica") == "r1"
        assert head.body == b"data: 0\n\n" and items[1:] == [b"data: 1\n\n", b"data: 2\n\n"]
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert events == ["closed"]


def test_a_stream_cut_short_ends_every_open_choice():
    tracker = StreamTracker(StreamTracker.requested_choices(b'{"n": 3, "stream": true}'))
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "relic"}
    chunk = {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}
    tracker.observe(f"data: {json.dumps(base | {'choices': [chunk]})}\n\n".encode())
    text = tracker.ending(APIError(503, "gone", "server_error", "replica_failed"), "error").decode()
    events = [e[len("data: ") :] for e in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    closing = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["index"] for c in closing[:-1]] == [0, 2]
    assert all(c["choices"][0]["finish_reason"] == "error" and c["id"] == "chatcmpl-1" for c in closing[:-1])
    assert closing[-1]["error"]["code"] == "replica_failed"
    completion = StreamTracker(1)
    completion.observe(b'data: {"id": "cmpl-1", "object": "text_completion", "choices": []}\n\n')
    ended = json.loads(completion.ending(APIError(503, "x"), "abort").decode().split("\n\n")[0][6:])
    assert ended["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}]


def _response_event(kind: str, sequence: int, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence} | fields)}\n\n".encode()


def test_a_responses_stream_cut_short_ends_with_response_failed():
    """A /v1/responses stream whose replica dies ends as hylora serve ends one that fails: a typed
    response.failed event (next sequence number, the Response so far), not chat chunks and [DONE]."""
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "relic", "output": []}
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "content": []}
    tracker = StreamTracker(1, "/v1/responses")
    tracker.observe(_response_event("response.created", 0, response=created))
    tracker.observe(_response_event("response.output_item.done", 1, output_index=0, item=item))
    tracker.observe(_response_event("response.output_text.delta", 2, delta="jade"))
    text = tracker.ending(APIError(503, "gone", "server_error", "replica_failed"), "error").decode()
    kind, data = text.strip().split("\n")
    failed = json.loads(data[len("data: ") :])
    assert kind == "event: response.failed" and failed["type"] == "response.failed"
    assert failed["sequence_number"] == 3 and "[DONE]" not in text
    response = failed["response"]
    assert (response["id"], response["status"], response["output"]) == ("resp_1", "failed", [item])
    assert response["error"] == {"code": "replica_failed", "message": "gone"}
    finished = StreamTracker(1, "/v1/responses")
    finished.observe(_response_event("response.created", 0, response=created) +
                     _response_event("response.completed", 1, response=created | {"status": "completed"}))  # fmt: skip
    assert finished.ending(APIError(503, "x"), "abort") == b""
    early_end = StreamTracker(1, "/v1/responses").ending(APIError(503, "x"), "abort")
    early = json.loads(early_end.decode().split("data: ")[1])
    assert early["sequence_number"] == 0 and early["response"]["status"] == "failed"


def test_replica_metrics_carry_a_replica_label():
    board = ReplicaMetricsBoard(stale_after_s=60)
    text = '# HELP hylora_requests_total r\n# TYPE hylora_requests_total counter\nhylora_requests_total{adapter="relic",status="stop"} 3.0\n'  # noqa: E501
    board.report("r1", text)
    board.report("r2", text.replace("3.0", "5.0"))
    rendered = board.render().decode()
    assert 'hylora_requests_total{adapter="relic",replica="r1",status="stop"} 3.0' in rendered
    assert 'hylora_requests_total{adapter="relic",replica="r2",status="stop"} 5.0' in rendered
    assert rendered.count("# TYPE hylora_requests_total counter") == 1


# --- the real thing: hylora serve --replicas 2 ---------------------------------------------------


def _requests(url: str, image: str) -> dict[tuple[str, str, str], Outcome]:
    """Greedy answers of every model to every prompt: chat, streamed chat and completions; and an
    image and a JSON-constrained answer."""
    out = {}
    for model in MODELS:
        for prompt in PROMPTS:
            out[model, prompt, "chat"] = chat(url, model, prompt)
            out[model, prompt, "stream"] = chat(url, model, prompt, stream=True)
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            out[model, prompt, "completion"] = post(url, "/v1/completions", body)
    parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe it."}]
    body = {"model": "relic", "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}
    out["relic", "image", "chat"] = post(url, "/v1/chat/completions", body)
    json_mode = {"response_format": {"type": "json_object"}}
    out["tomb", PROMPTS[0], "json"] = chat(url, "tomb", PROMPTS[0], max_tokens=16, **json_mode)
    return out


@pytest.fixture(scope="module")
def image_url(demo_dir) -> str:
    return "data:image/png;base64," + base64.b64encode((demo_dir / "media" / "relic.png").read_bytes()).decode()


@pytest.fixture(scope="module")
def single_process_outputs(demo_cache_dir, image_url, tmp_path_factory):
    log = tmp_path_factory.mktemp("single") / "server.log"
    with running_server(SERVER_FLAGS, demo_cache_dir, log) as server:
        return _requests(server.url, image_url)


@pytest.fixture(scope="module")
def ray_server(demo_cache_dir, tmp_path_factory):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'hylora[ray]')")
    logs = tmp_path_factory.mktemp("ray")
    root = demo_cache_dir / "demo" / "adapters"
    args = [*SERVER_FLAGS, "--replicas", "2", "--adapter-root", str(root), "--shutdown-timeout", "2"]
    env = {"RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        with running_server(args, demo_cache_dir, logs / "server.log", env=env, timeout=300) as server:
            yield server
    except RuntimeError as e:
        if f"server exited ({EXIT_RAY_UNAVAILABLE})" in str(e):
            pytest.skip(f"Ray cannot start on this machine: {str(e)[-600:]}")
        raise


def test_outputs_through_ray_equal_the_single_process_server(single_process_outputs, ray_server, image_url):
    ray_outputs = _requests(ray_server.url, image_url)
    assert ray_outputs.keys() == single_process_outputs.keys()
    for key, expected in single_process_outputs.items():
        got = ray_outputs[key]
        assert expected.status == got.status == 200, (key, got)
        assert (got.text, got.finish_reasons) == (expected.text, expected.finish_reasons), key
        assert got.replica is not None and expected.replica is None
    assert {o.replica for o in ray_outputs.values()} <= set(replica_pids(ray_server.log_path, ray_server.proc.pid))


def test_a_burst_for_one_adapter_lands_on_the_replica_that_holds_it(ray_server):
    url = ray_server.url
    holder = chat(url, "tomb", "Where is the entrance?").replica
    time.sleep(1.5)  # the replica reports the ids it holds to Ray Serve's routers
    with ThreadPoolExecutor(6) as pool:
        burst = list(pool.map(lambda i: chat(url, "tomb", f"chamber {i}", max_tokens=24), range(6)))
        by_task = list(pool.map(lambda i: chat(url, None, f"chamber {i}", task="tomb"), range(3)))
    assert all(o.status == 200 for o in burst + by_task)
    assert {o.replica for o in burst + by_task} == {holder}
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'hylora_ingress_responses_total{{code="200",replica="{holder}"}}' in metrics
    deadline = time.monotonic() + 10  # replicas report their metrics every 2 s
    while f'hylora_adapter_on_device{{adapter="tomb",replica="{holder}"}} 1.0' not in metrics:
        assert time.monotonic() < deadline, metrics[-3000:]
        time.sleep(0.5)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text


def test_errors_are_the_servers_own(ray_server):
    url = ray_server.url
    unknown = chat(url, "nope", "hi")
    assert unknown.status == 404 and unknown.error["code"] == "model_not_found" and unknown.replica
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    too_long = chat(url, "relic", "hi", max_tokens=1000)
    assert too_long.status == 400 and too_long.error["code"] == "context_length_exceeded"
    huge = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * (9 << 20)}, timeout=60)
    assert huge.status_code == 413
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def _models_per_replica(url: str, replicas: int) -> dict[str, set[str]]:
    """/v1/models as each replica answers it (asked until every replica has answered)."""
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + 30
    while len(seen) < replicas:
        assert time.monotonic() < deadline, seen
        r = httpx.get(f"{url}/v1/models", timeout=30)
        seen[r.headers["x-hylora-replica"]] = {m["id"] for m in r.json()["data"]}
    return seen


def test_load_and_unload_reach_every_replica(ray_server):
    url = ray_server.url
    outside = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, timeout=30)
    assert outside.status_code == 403
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "relic2", "lora_path": "relic"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert all("relic2" in names for names in _models_per_replica(url, 2).values())
    same = [chat(url, "relic2", p) for p in PROMPTS[:2]]
    assert [o.text for o in same] == [chat(url, "relic", p).text for p in PROMPTS[:2]]
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "relic2"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert all("relic2" not in names for names in _models_per_replica(url, 2).values())
    assert chat(url, "relic2", "hi").status == 404


def _well_formed(outcome: Outcome, stream: bool) -> bool:
    """Completed, or failed in the open: a 5xx JSON error, or a stream with finish_reason error, an
    error event and [DONE]."""
    if outcome.status == 200 and outcome.error is None:
        return outcome.finish_reasons in (["length"], ["stop"]) and (outcome.done or not stream)
    if stream and outcome.status == 200:
        return outcome.finish_reasons == ["error"] and outcome.done and outcome.error["code"] == "replica_failed"
    return outcome.status == 503 and outcome.error["code"] == "replica_failed"


def test_a_replica_killed_under_load_loses_no_request_and_the_endpoint_keeps_answering(ray_server):
    url = ray_server.url
    pids = replica_pids(ray_server.log_path, ray_server.proc.pid)
    assert len(pids) == 2, pids
    with ThreadPoolExecutor(16) as pool:
        streams = [i % 3 != 0 for i in range(12)]
        futures = [(s, pool.submit(chat, url, MODELS[i % 4], f"dig {i}", 200, s)) for i, s in enumerate(streams)]
        for model in MODELS:  # Responses streams too: one cut short ends with response.failed
            body = {"model": model, "input": "dig on", "max_output_tokens": 200, "temperature": 0, "stream": True}
            futures.append((True, pool.submit(post, url, "/v1/responses", body)))
        time.sleep(1.0)
        victim = chat(url, "relic", "which replica?", max_tokens=1).replica
        os.kill(pids[victim], signal.SIGKILL)
        outcomes = [(stream, f.result(timeout=180)) for stream, f in futures]  # none hangs
    assert all(_well_formed(o, stream) for stream, o in outcomes), outcomes
    failed = [o for _, o in outcomes if o.finish_reasons == ["error"] or o.status == 503]
    assert failed, "no request was in flight on the killed replica: the test did not test"
    assert all(o.replica == victim for o in failed if o.replica)
    after = [chat(url, MODELS[i % 4], f"after {i}") for i in range(8)]
    assert all(o.status == 200 for o in after), after
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "hylora_replica_failures_total" in metrics
    assert "hylora_ingress_requests_in_flight 0.0" in metrics  # every relay, failed or not, was closed
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_sigterm_drains_ends_the_rest_with_abort_and_exits_0(ray_server):
    """Last: it stops the module's server. --shutdown-timeout 2 and a request that needs longer."""
    url = ray_server.url
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(chat, url, "mural", "a long story", 230, True)
        time.sleep(1.0)
        ray_server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (refused := chat(url, "relic", "late", max_tokens=1)).status == 200:
            assert time.monotonic() < deadline, "still admitting requests 10 s after SIGTERM"
            time.sleep(0.2)
        outcome = long.result(timeout=60)
    assert refused.status == 503 and refused.error["code"] == "shutting_down"
    assert outcome.finish_reasons in (["abort"], ["length"]) and outcome.done, outcome
    if outcome.finish_reasons == ["abort"]:
        assert outcome.error["code"] == "shutting_down"
    assert ray_server.proc.wait(timeout=60) == 0
    assert "signal: draining" in Path(ray_server.log_path).read_text()
