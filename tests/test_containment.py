"""A request can only ever fail itself: every class of hostile or careless input, sent while a
streaming and a non-streaming greedy neighbour run, gets its own clear 4xx (or, for our faults, 5xx)
JSON error promptly; the neighbours' text and finish_reason equal a run without it; a request
afterwards is unchanged."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.hostile_helpers import Neighbours
from tests.server_helpers import running_server

BASE = "hylora-demo"
NEIGHBOUR_TOKENS = 160


@pytest.fixture(scope="module", params=["eager-decode", "padded-decode-ahead", "padded-speculating"])
def decode_mode(request):
    """Every test runs against the demo server three times: as it serves on the CPU; with decode and
    short steps padded as with CUDA graphs, so that decode ahead (the next step queued before the
    current one is read) runs under the same offenders; and padded while speculating with the demo's
    MTP layer (verify and drafting steps padded too)."""
    return request.param


@pytest.fixture(scope="module")
def root(decode_mode, tmp_path_factory, demo_dir):
    """The adapter root: copies of the demo adapters that tests change, break or load."""
    root = tmp_path_factory.mktemp("adapter-root")
    for name in ("changing", "vanishing", "spare"):
        shutil.copytree(demo_dir / "adapters" / "mural", root / name)
    return root


@pytest.fixture(scope="module")
def server(decode_mode, demo_cache_dir, root, tmp_path_factory):
    args = ["--demo", "--max-model-len", "512", "--max-num-seqs", "16", "--max-loras", "2", "--max-cpu-loras", "2"]
    args += ["--adapter-root", str(root), "--dtype", "float32", "--device", "cpu"]
    log = tmp_path_factory.mktemp("logs") / "server.log"
    padded = ["--padded-decode", "--max-short-step-tokens", "64"]  # decode and short steps as graphs pad them
    mode_args = {
        "eager-decode": [],
        "padded-decode-ahead": padded,
        "padded-speculating": [*padded, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
    }
    args += ["--enable-fault-injection", *mode_args[decode_mode]]
    with running_server(args, demo_cache_dir, log) as handle:
        yield handle.url


def chat(url: str, model: str | None, text: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0} | extra
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def raw(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def neighbours(url: str) -> Neighbours:
    """A streaming request on an adapter and a non-streaming one on the base model, greedy."""
    return Neighbours(url, {"stream": _neighbour_body("relic") | {"stream": True}, "plain": _neighbour_body(None)})


def _neighbour_body(model: str | None) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Describe the relic in the north chamber."}],
        "max_tokens": NEIGHBOUR_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return body | ({"model": model} if model else {})


@pytest.fixture(scope="module")
def baseline(server):
    with neighbours(server) as n:
        pass
    assert n.result["stream"][1] == "length" and n.result["plain"][1] == "length"
    return n.result


@pytest.fixture(scope="module")
def probe(server):
    """A short greedy request on the base model; asked again after each class it must not change."""
    reply = chat(server, BASE, "What is in the tomb?", max_tokens=12)
    assert reply.status_code == 200
    return reply.json()["choices"][0]["message"]["content"]


def contained(server, baseline, probe):
    """Context: run neighbours around the body; then check them and the probe."""

    class _Check:
        def __enter__(self):
            self.n = neighbours(server).__enter__()
            return self

        def __exit__(self, *exc):
            self.n.__exit__(*exc)
            if exc[0] is None:
                assert self.n.result == baseline, "a neighbour changed"
                assert not self.n.errors
                again = chat(server, BASE, "What is in the tomb?", max_tokens=12)
                assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == probe
                assert httpx.get(f"{server}/health", timeout=5).status_code == 200

    return _Check()


def assert_error(r: httpx.Response, status: int, *needles: str, within: float | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["message"] and error["type"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    if within is not None:
        assert r.elapsed.total_seconds() < within, r.elapsed


# --- sampling parameters ---------------------------------------------------------------------

REFUSED = [
    (dict(seed=2**64), "seed must be a 64-bit integer"),
    (dict(seed=2**63 - 1, n=2), "seed must be a 64-bit integer in [-2^63, 2^63 - n] (n = 2)"),
    (dict(seed=-(2**63) - 1), "seed must be"),
    (dict(temperature=2.5), "temperature must be a number in [0, 2]"),
    (dict(temperature=-1e-9), "temperature must be a number in [0, 2]"),
    (dict(top_p=0), "top_p must be a number in (0, 1]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k must be"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(logprobs=True, top_logprobs=21), "logprobs must be between 0 and 20"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=10**30), "maximum context length"),
    (dict(n=0), "n must be between 1 and 16"),
    (dict(n=17), "n must be between 1 and 16"),
    (dict(stop=[""]), "stop strings must not be empty"),
    (dict(stop=["x" * 600]), "at most 512 characters"),
    (dict(stop=["x"] * 100), "at most 64 stop strings"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids must be in"),
]
SERVED = [
    dict(temperature=1e-30),  # greedy
    dict(temperature=1e-4, seed=3),  # raised to 0.01: logits / T stays finite
    dict(temperature=1.0, repetition_penalty=1e6, seed=1),
    dict(temperature=1.0, presence_penalty=-2, frequency_penalty=2, seed=2),
    dict(temperature=1.0, min_p=1.0, seed=4),
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, top_p=1e-9, seed=5),
    dict(temperature=1.0, seed=-(2**63)),
    dict(temperature=1.0, seed=2**63 - 2, n=2),
]


def test_sampling_edge_values(server, baseline, probe):
    with contained(server, baseline, probe):
        for params, message in REFUSED:
            assert_error(chat(server, "tomb", "Where?", **params), 400, message, within=5)
        for raw_body in (b'"temperature": NaN', b'"top_p": Infinity', b'"seed": 1e400'):
            body = b'{"model": "tomb", "messages": [{"role": "user", "content": "x"}], ' + raw_body + b"}"
            assert_error(raw(server, "/v1/chat/completions", body), 400, within=5)
        for params in SERVED:
            r = chat(server, "tomb", "Where is the entrance?", **params)
            assert r.status_code == 200, (params, r.text)
            assert all(c["finish_reason"] in ("length", "stop") for c in r.json()["choices"])


# --- invalid Unicode ---------------------------------------------------------------------------


def test_invalid_unicode(server, baseline, probe):
    with contained(server, baseline, probe):
        chat_surrogate = b'{"model": "relic", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        assert_error(raw(server, "/v1/chat/completions", chat_surrogate), 400, "invalid Unicode", within=5)
        parts = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'
        assert_error(raw(server, "/v1/chat/completions", parts), 400, "invalid Unicode", within=5)
        prompt = b'{"model": "relic", "prompt": "x\\udc80", "max_tokens": 2}'
        assert_error(raw(server, "/v1/completions", prompt), 400, "invalid Unicode", within=5)
        stop = b'{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}'
        assert_error(raw(server, "/v1/completions", stop), 400, "invalid Unicode", within=5)
        not_utf8 = b'{"model": "relic", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'
        assert_error(raw(server, "/v1/chat/completions", not_utf8), 400, within=5)
        key = b'{"prompt": "x", "max_tokens": 2, "extra": {"\\ud800": 1}}'
        assert_error(raw(server, "/v1/completions", key), 400, "invalid Unicode", within=5)


# --- broken adapter directories -----------------------------------------------------------------


def _broken_configs(demo_dir: Path) -> dict[str, bytes | dict | list | str]:
    good = json.loads((demo_dir / "adapters" / "mural" / "adapter_config.json").read_text())
    bad: dict[str, bytes | dict | list | str] = {
        "r_string": good | {"r": "8"},
        "r_float": good | {"r": 8.5},
        "r_bool": good | {"r": True},
        "r_negative": good | {"r": -4},
        "r_null": good | {"r": None},
        "alpha_string": good | {"lora_alpha": "sixteen"},
        "alpha_list": good | {"lora_alpha": [16]},
        "targets_int": good | {"target_modules": 5},
        "targets_list_of_ints": good | {"target_modules": [1, 2]},
        "targets_dict": good | {"target_modules": {"q_proj": True}},
        "rank_pattern_list": good | {"rank_pattern": ["q_proj"]},
        "rank_pattern_string_value": good | {"rank_pattern": {"q_proj": "8"}},
        "alpha_pattern_null_value": good | {"alpha_pattern": {"q_proj": None}},
        "layers_string": good | {"layers_to_transform": "0"},
        "rslora_string": good | {"use_rslora": "yes"},
        "dora_number": good | {"use_dora": 1},
        "peft_type_list": good | {"peft_type": ["LORA"]},
        "config_list": [good],
        "config_string": "LORA",
        "config_null": None,  # type: ignore[dict-item]
        "not_utf8": b'{"r": 8, "target_modules": "\xff\xfe"}',
        "not_json": b"{r: 8",
        "empty": b"",
        "deeply_nested": b"[" * 100_000 + b"]" * 100_000,
        "huge": b'{"r": 8, "pad": "' + b"x" * (2 << 20) + b'"}',
        "nul_in_targets": good | {"target_modules": ["q_proj\u0000"]},
        "bad_regex": good | {"target_modules": "(unclosed"},
    }
    return bad


def test_broken_adapter_configs_of_every_kind(server, baseline, probe, root, demo_dir):
    weights = demo_dir / "adapters" / "mural" / "adapter_model.safetensors"
    cases = _broken_configs(demo_dir)
    for name, content in cases.items():
        d = root / f"cfg_{name}"
        d.mkdir()
        shutil.copy(weights, d / "adapter_model.safetensors")
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        (d / "adapter_config.json").write_bytes(data)
    with contained(server, baseline, probe):
        for name in cases:
            assert_error(load(server, "x", f"cfg_{name}"), 400, within=5)
    models = {m["id"] for m in httpx.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert "x" not in models


PATHOLOGICAL = r"(.*)(.*)(.*)(.*)(.*)(.*)\6\5\4\3\2\1"  # freezes Python's re for minutes


@pytest.mark.parametrize(
    "field, value",
    [
        ("target_modules", PATHOLOGICAL),
        ("exclude_modules", PATHOLOGICAL),
        ("rank_pattern", {PATHOLOGICAL: 4}),
        ("target_modules", r"((model|layers|\w)+\.?)*\$\$"),
        ("target_modules", "(?<=a)*+"),
    ],
)
def test_slow_or_invalid_target_patterns_are_refused_quickly(server, root, demo_dir, field, value):
    d = root / f"regex_{abs(hash((field, str(value))))}"
    shutil.copytree(demo_dir / "adapters" / "mural", d)
    config = json.loads((d / "adapter_config.json").read_text()) | {field: value}
    (d / "adapter_config.json").write_text(json.dumps(config))
    health: list[float] = []

    def poll():
        for _ in range(10):
            start = time.monotonic()
            httpx.get(f"{server}/health", timeout=10)
            health.append(time.monotonic() - start)

    poller = threading.Thread(target=poll)
    poller.start()
    r = load(server, "regex", d.name)
    poller.join()
    assert r.status_code == 400 and r.elapsed.total_seconds() < 5, (r.status_code, r.text, r.elapsed)
    assert max(health) < 1.0  # the event loop kept answering


def test_paths_names_and_links(server, baseline, probe, root):
    (root / "loop").symlink_to(root / "loop")
    (root / "loop_a").symlink_to(root / "loop_b")
    (root / "loop_b").symlink_to(root / "loop_a")
    (root / "looped_weights").mkdir()
    shutil.copy(root / "spare" / "adapter_config.json", root / "looped_weights")
    (root / "looped_weights" / "adapter_model.safetensors").symlink_to(
        root / "looped_weights" / "adapter_model.safetensors"
    )
    with contained(server, baseline, probe):
        assert_error(load(server, "x", "loop"), 400, within=5)
        assert_error(load(server, "x", "loop_a"), 400, within=5)
        assert_error(load(server, "x", "looped_weights"), 400, within=5)
        assert_error(load(server, "x", "spare\u0000/etc"), 400, within=5)
        assert_error(load(server, "x", "a" * 5000), 400, within=5)
        assert_error(load(server, "x", "/".join(["d" * 250] * 30)), 400, within=5)
        assert_error(load(server, BASE, "spare"), 400, "base model's name", within=5)
        assert_error(load(server, "a/b", "spare"), 400, within=5)
        assert_error(load(server, "n" * 200, "spare"), 400, within=5)
        r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": BASE}, timeout=10)
        assert_error(r, 404, within=5)


# --- adapter files that change after loading ---------------------------------------------------


def test_changed_or_deleted_adapter_files_fail_that_adapter_alone(server, baseline, probe, root, demo_dir):
    assert load(server, "changing", "changing").status_code == 200
    assert load(server, "vanishing", "vanishing").status_code == 200
    expected = chat(server, "changing", "Where?").json()["choices"][0]["message"]["content"]
    for model in ("tomb", "mural", BASE):  # evict both from the device and the 2-entry CPU cache
        assert chat(server, model, "Where?").status_code == 200
    shutil.copytree(demo_dir / "adapters" / "tomb", root / "changing", dirs_exist_ok=True)  # new weights
    os.remove(root / "vanishing" / "adapter_model.safetensors")
    with contained(server, baseline, probe):
        assert_error(chat(server, "changing", "Where?"), 409, "changed on disk since it was loaded", within=10)
        assert_error(chat(server, "changing", "Where?"), 409, "cannot be served any more", within=5)
        assert_error(chat(server, "vanishing", "Where?"), 409, "no adapter_model.safetensors", within=10)
    # loading it again serves what is on disk now (tomb's weights), under the same name
    assert load(server, "changing", "changing").status_code == 200
    tomb = chat(server, "tomb", "Where?").json()["choices"][0]["message"]["content"]
    again = chat(server, "changing", "Where?").json()["choices"][0]["message"]["content"]
    assert again == tomb and again != expected


def test_unload_while_waiting_for_a_slot(server, root):
    """Both LoRA slots are held by running requests; a request for a third adapter waits for one;
    unloading that adapter meanwhile fails the waiting request alone, with a 404."""
    assert load(server, "spare", "spare").status_code == 200
    holders = {}

    def hold(model):
        body = _neighbour_body(model) | {"max_tokens": 300}
        holders[model] = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)

    threads = [threading.Thread(target=hold, args=(m,)) for m in ("relic", "tomb")]
    for t in threads:
        t.start()
    time.sleep(0.5)
    waiting: dict = {}
    waiter = threading.Thread(target=lambda: waiting.setdefault("r", chat(server, "spare", "Where?")))
    waiter.start()
    time.sleep(0.3)
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "spare"}, timeout=10).status_code == 200
    waiter.join(60)
    for t in threads:
        t.join(120)
    assert_error(waiting["r"], 404, "was unloaded before this request started")
    assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" for r in holders.values())


# --- faults inside the engine --------------------------------------------------------------------


def test_a_request_that_breaks_the_forward_fails_alone(server, baseline, probe):
    with contained(server, baseline, probe):
        r = chat(server, "tomb", "Where?", hylora_inject_fault="raise")
        assert_error(r, 500, "injected fault in the forward of request", within=30)
        assert r.json()["error"]["code"] == "internal_error"
        r = chat(server, "mural", "Where?", hylora_inject_fault="nan")
        assert_error(r, 500, "numerical fault", within=30)
        assert r.json()["error"]["code"] == "numerical_fault"


def test_failed_stream_ends_with_error_event_and_finish_reason(server):
    body = {"model": "mural", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 20, "stream": True}
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=body | {"hylora_inject_fault": "nan"}, timeout=60
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    assert finishes == ["error"]
    assert events[-1]["error"]["code"] == "numerical_fault" and lines[-1] == "data: [DONE]"


def test_decode_ahead_ran_on_the_padded_server(server, decode_mode):
    # last in this module: the offenders above ran beside neighbours whose decode steps were planned ahead
    metrics = httpx.get(f"{server}/metrics", timeout=30).text

    def gauge(name: str) -> float:
        return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))

    ahead, planned = gauge("hylora_decode_steps_ahead"), gauge("hylora_prefill_steps_ahead")
    if decode_mode in ("padded-decode-ahead", "padded-speculating"):
        assert ahead > 50  # speculating: verify steps planned ahead
    else:
        assert ahead == 0  # eager decode: nothing to queue ahead
    # the offenders' prompts and admissions were planned ahead beside the neighbours' steps (not while speculating)
    assert (planned > 10) == (decode_mode == "padded-decode-ahead")
    drafts = sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")
    )
    assert (drafts > 0) == (decode_mode == "padded-speculating")  # the offenders ran beside verify steps
