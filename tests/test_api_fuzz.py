"""Property-based fuzzing of the HTTP API: bodies built from the request models' fields with values
of every JSON type (and some that are not valid JSON numbers or Unicode). Whatever is sent, the
server answers with a 2xx or a 4xx OpenAI-style JSON error — never a 5xx, never a hang, never a
stream without an end — and afterwards it is healthy and a probe request is unchanged."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server_helpers import running_server

EXAMPLES = int(os.environ.get("HYLORA_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "relic", "hylora-demo", "", "-1", "1e999", "text", "json_object"]),
)
anything = st.recursive(
    scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
small_int = st.one_of(st.integers(-2, 5), st.integers(-(2**70), 2**70))
unit = st.one_of(st.floats(-1, 3), st.sampled_from([0.0, 1e-30, 1e-4, 1.0, 2.0]))
text = st.one_of(st.text(max_size=40), st.just("a\ud800b"))
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "video_url"]), anything, max_size=3),
    anything,
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(text, st.lists(part, max_size=3)),
        }
    ),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), anything, max_size=3),
    anything,
)
COMMON = {
    "model": st.one_of(st.sampled_from(["relic", "tomb", "mural", "hylora-demo", "nope"]), anything),
    "task": st.one_of(st.sampled_from(["relic", "tomb", "x"]), anything),
    "max_tokens": st.one_of(st.integers(1, 4), small_int, anything),
    "temperature": st.one_of(unit, anything),
    "top_p": st.one_of(unit, anything),
    "top_k": st.one_of(small_int, anything),
    "min_p": st.one_of(unit, anything),
    "presence_penalty": st.one_of(unit, anything),
    "frequency_penalty": st.one_of(unit, anything),
    "repetition_penalty": st.one_of(unit, st.floats(0, 1e6), anything),
    "seed": st.one_of(small_int, st.sampled_from([2**63 - 1, 2**64, -(2**63)]), anything),
    "stop": st.one_of(text, st.lists(text, max_size=3), anything),
    "stop_token_ids": st.one_of(st.lists(small_int, max_size=3), anything),
    "ignore_eos": st.one_of(st.booleans(), anything),
    "n": st.one_of(st.integers(0, 3), small_int, anything),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), anything),
    "logit_bias": anything,
    "best_of": anything,
}
CHAT = COMMON | {
    "messages": st.one_of(st.lists(message, min_size=1, max_size=3), anything),
    "max_completion_tokens": st.one_of(st.integers(1, 4), anything),
    "logprobs": st.one_of(st.booleans(), anything),
    "top_logprobs": st.one_of(st.integers(-1, 25), anything),
    "response_format": st.one_of(st.just({"type": "text"}), anything),
    "tools": anything,
}
COMPLETION = COMMON | {
    "prompt": st.one_of(text, st.lists(st.integers(-5, 400), max_size=6), st.lists(text, max_size=2), anything),
    "echo": st.one_of(st.booleans(), anything),
    "logprobs": st.one_of(st.integers(-1, 25), anything),
    "suffix": anything,
}
input_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "text"]), "text": text}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": st.one_of(text, anything)}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "file_id"]), anything, max_size=3),
    anything,
)
input_item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer"]),
            "content": st.one_of(text, st.lists(input_part, max_size=3)),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.one_of(text, anything),
            "name": st.one_of(text, anything),
            "arguments": st.one_of(st.just('{"a": 1}'), text, anything),
        }  # fmt: skip
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.one_of(text, anything), "output": anything}
    ),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": anything}),
    st.dictionaries(st.sampled_from(["type", "role", "content", "call_id", "name", "arguments"]), anything, max_size=4),
)
function_tool = st.fixed_dictionaries(
    {"type": st.just("function"), "name": st.one_of(st.just("lookup"), text, anything)},
    optional={"parameters": st.one_of(st.just({"type": "object", "properties": {}}), anything), "strict": anything},
)
RESPONSES = {
    "model": COMMON["model"],
    "task": COMMON["task"],
    "input": st.one_of(text, st.lists(input_item, min_size=1, max_size=3), anything),
    "instructions": st.one_of(text, anything),
    "max_output_tokens": st.one_of(st.integers(1, 4), small_int, anything),
    "temperature": COMMON["temperature"],
    "top_p": COMMON["top_p"],
    "tools": st.one_of(st.lists(function_tool, max_size=2), anything),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), anything),
    "text": st.one_of(st.just({"format": {"type": "json_object"}}), st.dictionaries(st.just("format"), anything)),
    "include": st.one_of(st.just(["message.output_text.logprobs"]), anything),
    "top_logprobs": st.one_of(st.integers(-1, 25), anything),
    "stream": st.booleans(),
    "store": anything,
    "previous_response_id": anything,
    "truncation": anything,
    "metadata": anything,
    "seed": COMMON["seed"],
    "stop": COMMON["stop"],
}
TOKENIZE = {
    "model": COMMON["model"],
    "prompt": st.one_of(text, anything),
    "messages": CHAT["messages"],
    "add_special_tokens": anything,
    "add_generation_prompt": anything,
    "continue_final_message": anything,
    "chat_template_kwargs": anything,
    "tools": anything,
    "return_token_strs": anything,
}
DETOKENIZE = {
    "model": COMMON["model"],
    "tokens": st.one_of(st.lists(st.integers(-3, 300), max_size=6), st.lists(small_int, max_size=3), anything),
}
LOAD = {
    "lora_name": st.one_of(text, anything),
    "lora_path": st.one_of(text, st.sampled_from(["spare", ".."]), anything),
}

# Values inside the documented ranges, edges included: these requests reach the engine and run.
valid_text = st.text(st.characters(codec="utf-8"), max_size=30)
VALID_COMMON = {
    "model": st.sampled_from(["relic", "tomb", "mural", "hylora-demo"]),
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0.0, 1e-30, 1e-5, 1e-3, 2.0])),
    "top_p": st.one_of(st.floats(1e-9, 1), st.just(1.0)),
    "top_k": st.integers(-1, 2000),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.floats(1e-6, 1e6), st.sampled_from([1e-300, 1e6])),
    "seed": st.one_of(st.integers(-(2**63), 2**63 - 4), st.just(-1)),
    "stop": st.one_of(valid_text.filter(bool), st.lists(valid_text.filter(bool), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=4),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
}
VALID_CHAT = VALID_COMMON | {
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": valid_text}),
        min_size=1,
        max_size=3,
    ),
    "logprobs": st.booleans(),
}
VALID_COMPLETION = VALID_COMMON | {
    "prompt": st.one_of(valid_text.filter(bool), st.lists(st.integers(0, 1000), min_size=1, max_size=20)),
    "echo": st.booleans(),
    "logprobs": st.integers(0, 20),
}

VALID_RESPONSES = {
    "model": VALID_COMMON["model"],
    "input": st.one_of(
        valid_text.filter(bool),
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]), "content": valid_text}),
            min_size=1,
            max_size=3,
        ),
    ),
    "instructions": valid_text,
    "max_output_tokens": st.integers(1, 6),
    "temperature": VALID_COMMON["temperature"],
    "top_p": VALID_COMMON["top_p"],
    "include": st.just(["message.output_text.logprobs"]),
    "top_logprobs": st.integers(0, 5),
    "stream": st.booleans(),
    "seed": VALID_COMMON["seed"],
}


def bodies(hostile: dict, valid: dict, required: tuple[str, ...]) -> st.SearchStrategy:
    def request(fields: dict) -> st.SearchStrategy:
        return st.fixed_dictionaries(
            {k: fields[k] for k in required}, optional={k: v for k, v in fields.items() if k not in required}
        )

    return st.one_of(request(valid), request(hostile), anything)


@pytest.fixture(scope="module")
def server(demo_cache_dir, demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-root")
    import shutil

    shutil.copytree(demo_dir / "adapters" / "mural", root / "spare")
    args = ["--demo", "--max-model-len", "96", "--max-num-seqs", "16", "--adapter-root", str(root)]
    args += ["--dtype", "float32", "--device", "cpu"]
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield handle.url


def probe(url: str) -> str:
    body = {"model": "relic", "messages": [{"role": "user", "content": "Describe."}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def before(server):
    return probe(server)


def send(url: str, path: str, body: object) -> None:
    data = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity as Python writes them
    headers = {"Content-Type": "application/json"}
    streaming = isinstance(body, dict) and body.get("stream") is True
    with httpx.stream("POST", f"{url}{path}", content=data, headers=headers, timeout=60) as r:
        event(f"{path} {r.status_code}")
        assert r.status_code < 500, (r.status_code, r.read()[:300], body)
        if r.status_code >= 400 or not streaming or r.headers["content-type"].startswith("application/json"):
            payload = json.loads(r.read())
            if r.status_code >= 400:
                assert payload["error"]["message"] and payload["error"]["type"], payload
            return
        lines = [line for line in r.iter_lines() if line]
    if path == "/v1/responses":
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), events[-3:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "internal server error" not in ((events[-1]["response"].get("error") or {}).get("message") or "")
        return
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    finished = {c["index"] for e in events for c in e.get("choices", []) if c.get("finish_reason")}
    n = body.get("n", 1) if isinstance(body, dict) else 1
    assert finished == set(range(n if isinstance(n, int) else 1)), events[-3:]
    errors = [e for e in events if "error" in e]
    assert not any(e["error"]["code"] == "internal_error" for e in errors), errors


@FUZZ
@given(body=bodies(CHAT, VALID_CHAT, ("messages",)))
def test_fuzz_chat_completions(server, before, body):
    send(server, "/v1/chat/completions", body)


@FUZZ
@given(body=bodies(COMPLETION, VALID_COMPLETION, ("prompt",)))
def test_fuzz_completions(server, before, body):
    send(server, "/v1/completions", body)


@FUZZ
@given(body=bodies(RESPONSES, VALID_RESPONSES, ("input",)))
def test_fuzz_responses(server, before, body):
    send(server, "/v1/responses", body)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(body=st.one_of(bodies(TOKENIZE, TOKENIZE, ()), bodies(DETOKENIZE, DETOKENIZE, ("tokens",))))
def test_fuzz_tokenize_endpoints(server, before, body):
    send(server, "/detokenize" if isinstance(body, dict) and "tokens" in body else "/tokenize", body)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(body=bodies(LOAD, LOAD, ("lora_name", "lora_path")), unload=st.booleans())
def test_fuzz_adapter_endpoints(server, before, body, unload):
    send(server, "/v1/unload_lora_adapter" if unload else "/v1/load_lora_adapter", body)


def test_server_is_healthy_and_unchanged_after_fuzzing(server, before):
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert probe(server) == before
