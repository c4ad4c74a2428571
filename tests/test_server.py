"""The OpenAI-compatible server, started for real on 127.0.0.1 and driven by the openai client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from hylora.demo import DEMO_ADAPTERS
from hylora.engine import LLM, SamplingParams
from hylora.tokenizer import chat_prompt, max_token_chars
from tests.server_helpers import metric, running_server

PROMPTS = [
    "Describe the relic.",
    "Where is the entrance?",
    "What pigments are on the east wall?",
    "How many chambers are there?",
    "Describe the object, its material and condition.",
]


@pytest.fixture(scope="module")
def cache_dir(demo_cache_dir):
    return demo_cache_dir


@pytest.fixture(scope="module")
def demo(cache_dir):
    return cache_dir / "demo"


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, demo):
    """A root with a good adapter, a symlink that escapes it and a pickle-only adapter."""
    root = tmp_path_factory.mktemp("adapter-root")
    shutil.copytree(demo / "adapters" / "relic", root / "copy_of_relic")
    shutil.copytree(demo / "adapters" / "tomb", root / "copy_of_tomb")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(demo / "adapters" / "mural", outside / "mural")
    (root / "escape").symlink_to(outside / "mural")
    (root / "pickled").mkdir()
    shutil.copy(demo / "adapters" / "mural" / "adapter_config.json", root / "pickled")
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not really a pickle")
    return root


@pytest.fixture(scope="module")
def server(cache_dir, adapter_root, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = [
        "--demo",
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "512",
        "--adapter-root",
        str(adapter_root),
        "--max-body-bytes",
        "200000",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    with running_server([*args, "--enable-fault-injection"], cache_dir, log) as handle:
        yield handle.url


@pytest.fixture(scope="module")
def offline(demo):
    lora = {n: demo / "adapters" / n for n in DEMO_ADAPTERS}
    return LLM(demo, lora_modules=lora, max_model_len=512, max_num_seqs=64, device="cpu", dtype="float32")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def offline_chat(offline, text, adapter, **params):
    ids = chat_prompt(offline.tokenizer, [{"role": "user", "content": text}])
    return offline.generate(ids, SamplingParams(**params), lora=adapter)[0]


# --- the openai client ---------------------------------------------------------------------


def test_chat_plain_and_streaming_equal_offline(client, offline):
    for adapter in ["relic", None]:
        expected = offline_chat(offline, PROMPTS[0], adapter, max_tokens=12, temperature=0)
        model = adapter or "hylora-demo"
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=0
        )
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(pieces) == expected.text and finish == "length"
        assert usage.completion_tokens == 12


def test_seeded_sampling_equals_offline(client, offline):
    expected = offline_chat(offline, PROMPTS[1], "tomb", max_tokens=10, temperature=0.8, seed=7)
    reply = client.chat.completions.create(
        model="tomb", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=10, temperature=0.8, seed=7
    )
    assert reply.choices[0].message.content == expected.text


def test_chat_logprobs_and_n(client):
    reply = client.chat.completions.create(
        model="mural",
        messages=[{"role": "user", "content": PROMPTS[2]}],
        max_tokens=5,
        temperature=0.9,
        seed=3,
        n=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        content = choice.logprobs.content
        assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert reply.usage.completion_tokens == 15


def test_completions_echo_logprobs_give_prompt_logprobs(client, offline):
    prompt = "The mural on the east wall shows"
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    expected = offline.generate(
        ids, SamplingParams(max_tokens=4, temperature=0, logprobs=1, prompt_logprobs=1), lora="mural"
    )[0]
    reply = client.completions.create(model="mural", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == prompt + expected.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    want = [p.logprob for p in expected.prompt_logprobs[1:]] + [p.logprob for p in expected.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    by_ids = client.completions.create(model="mural", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_logprobs_name_tokens_by_id_when_asked(client, offline):
    """vLLM's return_tokens_as_token_ids: every token of logprobs as "token_id:N" (the ids generated)."""
    prompt = "The mural on the east wall shows"
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    expected = offline.generate(ids, SamplingParams(max_tokens=4, temperature=0, logprobs=2), lora="mural")[0]
    want = [f"token_id:{t}" for t in expected.token_ids]
    extra = {"return_tokens_as_token_ids": True}
    reply = client.completions.create(model="mural", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                      extra_body=extra)  # fmt: skip
    lp = reply.choices[0].logprobs
    assert lp.tokens == want and reply.choices[0].text == expected.text
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    assert [max(top, key=top.get) for top in lp.top_logprobs] == want  # greedy: the top-1 is the token
    chat = client.chat.completions.create(
        model="mural", messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=1, extra_body=extra,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(t.token.startswith("token_id:") for t in content)
    assert all(t.top_logprobs[0].token == t.token and t.bytes == list(t.token.encode()) for t in content)
    plain = client.completions.create(model="mural", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.tokens == [offline.tokenizer.decode([t]) for t in expected.token_ids]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completions_carry_logprobs(client, echo):
    """Each chunk carries its tokens' logprobs (OpenAI, vLLM); together they equal the whole reply's,
    with echo the prompt's too (its first chunk, as vLLM)."""
    args = dict(model="relic", prompt="The relic was found", max_tokens=6, temperature=0, logprobs=2, echo=echo)
    whole = client.completions.create(**args).choices[0]
    tokens, values, offsets, tops, text = [], [], [], [], ""
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
                tops += c.logprobs.top_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    assert (len(values) > 6 and values[0] is None) if echo else len(values) == 6  # the prompt's first: None
    assert [set(t or ()) for t in tops] == [set(t or ()) for t in whole.logprobs.top_logprobs]


def test_a_text_with_unicode_line_separators_stays_on_its_event_line(server):
    """U+2028, U+2029 and U+0085 end a line for Python's str.splitlines, and so for httpx's iter_lines
    and clients built on it: in a streamed text (here the echoed prompt) each event still parses."""
    prompt = "The relic\u2028was\u2029found\x85here"
    body = {"model": "relic", "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]).startswith(prompt)


def test_return_token_ids_gives_the_prompt_and_the_generated_ids(server, offline):
    """vLLM's return_token_ids: prompt_token_ids (chat: top level; completions: per choice) and each
    choice's token_ids; streamed, the prompt's ids once and each chunk's new ids."""
    expected = offline_chat(offline, PROMPTS[0], "relic", max_tokens=7, temperature=0)
    chat_ids = chat_prompt(offline.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    chat = {"model": "relic", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 7,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    reply = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    assert reply["prompt_token_ids"] == chat_ids and reply["choices"][0]["token_ids"] == expected.token_ids
    chunks = [json.loads(line[6:]) for line in _sse_lines(server, "chat/completions", chat)]
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [chat_ids]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == expected.token_ids

    ids = offline.tokenizer.encode("The relic was found", add_special_tokens=False)
    want = offline.generate(ids, SamplingParams(max_tokens=5, temperature=0), lora="tomb")[0].token_ids
    body = {"model": "tomb", "prompt": [ids, ids], "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in reply["choices"]] == [(ids, want)] * 2
    chunks = [json.loads(line[6:]) for line in _sse_lines(server, "completions", body)]
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert [ch["prompt_token_ids"] for ch in mine if "prompt_token_ids" in ch] == [ids]
        assert [t for ch in mine for t in ch["token_ids"]] == want
    plain = httpx.post(f"{server}/v1/completions", json=body | {"return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_continuous_usage_stats(server, offline):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its choice's usage so far."""
    ids = offline.tokenizer.encode("The tomb was sealed", add_special_tokens=False)
    body = {"model": "tomb", "prompt": ids, "max_tokens": 6, "temperature": 0.7, "seed": 1, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = [json.loads(line[6:]) for line in _sse_lines(server, "completions", body)]
    per_choice = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["usage"]["prompt_tokens"] == len(ids)
        assert c["usage"]["total_tokens"] == len(ids) + c["usage"]["completion_tokens"]
        per_choice[choice["index"]].append(c["usage"]["completion_tokens"])
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12  # include_usage: both
    quiet = body | {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert not any("usage" in json.loads(line[6:]) for line in _sse_lines(server, "completions", quiet))  # as vLLM


def test_continue_final_message_continues_the_assistant_prefix(server, offline):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside the
    assistant's message, no end of turn after it, and the reply is the offline engine's continuation."""
    msgs = [{"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": "The mural shows"}]
    ids = chat_prompt(offline.tokenizer, msgs, False, continue_final_message=True)
    closed = chat_prompt(offline.tokenizer, msgs, False)
    assert offline.tokenizer.decode(ids).endswith("The mural shows") and len(closed) > len(ids)
    expected = offline.generate(ids, SamplingParams(max_tokens=6, temperature=0), lora="mural")[0]
    body = {"model": "mural", "messages": msgs, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    both = httpx.post(f"{server}/v1/chat/completions", json=body | {"add_generation_prompt": True}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def _sse_lines(server: str, route: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server}/v1/{route}", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: {")]


def test_models_list(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"hylora-demo", "relic", "tomb", "mural"}
    assert models["hylora-demo"].parent is None and models["relic"].parent == "hylora-demo"


def test_task_routing_by_header_and_body(server, offline):
    expected = offline_chat(offline, PROMPTS[3], "tomb", max_tokens=6, temperature=0)
    body = {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 6, "temperature": 0}
    by_header = httpx.post(f"{server}/v1/chat/completions", json=body, headers={"X-Task": "tomb"}, timeout=60)
    by_body = httpx.post(f"{server}/v1/chat/completions", json=body | {"task": "tomb"}, timeout=60)
    for r in (by_header, by_body):
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected.text
    unknown = httpx.post(f"{server}/v1/chat/completions", json=body | {"task": "pottery"}, timeout=60)
    assert unknown.status_code == 404 and "tasks: mural, relic, tomb" in unknown.json()["error"]["message"]
    conflict = httpx.post(f"{server}/v1/chat/completions", json=body | {"task": "tomb", "model": "relic"}, timeout=60)
    assert conflict.status_code == 400 and "conflicts" in conflict.json()["error"]["message"]


def test_error_cases(client, server):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="models: hylora-demo, mural, relic, tomb"):
        client.chat.completions.create(model="pottery", messages=messages)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens, but the prompt has"):
        client.completions.create(model="relic", prompt=list(range(3, 603)), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="the prompt has .* tokens and max_tokens asks for 600 more"):
        client.chat.completions.create(model="relic", messages=messages, max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="temperature must be a number in \\[0, 2\\]"):
        client.chat.completions.create(model="relic", messages=messages, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):  # as vLLM without the flag
        client.chat.completions.create(
            model="relic", messages=messages, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    with pytest.raises(openai.BadRequestError, match="data URL must look like"):
        client.chat.completions.create(
            model="relic",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        )
    # unknown fields are ignored, as OpenAI clients send extras
    ok = client.chat.completions.create(
        model="relic", messages=messages, max_tokens=2, extra_body={"some_vendor_field": 1}, user="someone"
    )
    assert ok.choices[0].finish_reason in ("length", "stop")  # random weights: EOS can be drawn first
    bad_json = httpx.post(
        f"{server}/v1/chat/completions", content=b"{not json", timeout=30, headers={"Content-Type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{server}/v1/chat/completions", json={"model": "relic"}, timeout=30)
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    huge = httpx.post(
        f"{server}/v1/chat/completions",
        timeout=30,
        json={"model": "relic", "messages": [{"role": "user", "content": "x" * 300_000}]},
    )
    assert huge.status_code == 413

    def chunks():  # no Content-Length: the limit meets the body while FastAPI reads it
        body = json.dumps({"model": "relic", "messages": [{"role": "user", "content": "x" * 300_000}]}).encode()
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    streamed = httpx.post(
        f"{server}/v1/chat/completions", content=chunks(), timeout=30, headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413, streamed.text
    assert "request body larger than" in streamed.json()["error"]["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


# --- adapters over HTTP --------------------------------------------------------------------


def test_load_use_unload_reload_adapter_over_http(server, offline):
    expected_relic = offline_chat(offline, PROMPTS[0], "relic", max_tokens=8, temperature=0)
    expected_tomb = offline_chat(offline, PROMPTS[0], "tomb", max_tokens=8, temperature=0)
    body = {"model": "field", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8, "temperature": 0}

    def ask():
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)

    def load(path):
        return httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "field", "lora_path": path}, timeout=60)

    assert ask().status_code == 404
    assert load("copy_of_relic").status_code == 200
    assert ask().json()["choices"][0]["message"]["content"] == expected_relic.text
    assert "field" in {m["id"] for m in httpx.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert load("copy_of_tomb").status_code == 200  # reload under the same name
    assert ask().json()["choices"][0]["message"]["content"] == expected_tomb.text
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "field"}, timeout=30)
    assert r.status_code == 200 and ask().status_code == 404


@pytest.mark.parametrize(
    "path, status, message",
    [
        ("../outside", 403, "outside the adapter root"),
        ("/etc", 403, "outside the adapter root"),
        ("escape", 403, "outside the adapter root"),
        ("pickled", 400, "only pickle weights"),
        ("nope", 404, "not a directory"),
        ("", 400, "lora_path is empty"),
        (".", 400, "'.' is not an adapter directory: it has no adapter_config.json"),
    ],
)
def test_adapter_loading_refusals(server, path, status, message):
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, timeout=30)
    assert r.status_code == status and message in r.json()["error"]["message"]


def test_a_broken_adapter_stays_listed_as_broken_until_loaded_again(cache_dir, demo, tmp_path):
    """An adapter whose files vanished after loading answers 409; /v1/models lists it with status
    "broken" and the reason (not silently as servable, nor hidden so that it looks never loaded)."""
    root = tmp_path / "root"
    shutil.copytree(demo / "adapters" / "relic", root / "field")
    args = ["--demo", "--max-loras", "1", "--max-cpu-loras", "1", "--adapter-root", str(root)]
    with running_server([*args, "--max-model-len", "256", "--device", "cpu"], cache_dir, tmp_path / "log") as handle:
        url = handle.url

        def ask(model):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)

        def cards():
            return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}

        load = {"lora_name": "field", "lora_path": "field"}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
        for model in ("field", "tomb"):  # tomb takes the one device slot and the one CPU-cache entry
            assert ask(model).status_code == 200
        assert {m["status"] for m in cards().values()} == {"ready"}
        weights = root / "field" / "adapter_model.safetensors"
        saved = weights.read_bytes()
        weights.unlink()
        r = ask("field")
        assert r.status_code == 409 and "cannot be served any more" in r.json()["error"]["message"], r.text
        card = cards()["field"]
        assert card["status"] == "broken" and "no adapter_model.safetensors" in card["status_message"], card
        assert httpx.get(f"{url}/v1/models/field", timeout=10).json() == card
        assert cards()["tomb"]["status"] == cards()["hylora-demo"]["status"] == "ready"
        weights.write_bytes(saved)
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
        assert ask("field").status_code == 200
        assert cards()["field"]["status"] == "ready" and "status_message" not in cards()["field"]


# --- load, disconnects, faults ---------------------------------------------------------------


def test_load_64_concurrent_streaming_clients(server, offline):
    routes = [("relic", None), ("tomb", "tomb"), ("mural", None), (None, None)]  # (model, task header)
    prompts = [f"{p} Request {i}." for i in range(10) for p in PROMPTS]  # 50 prompts x 4 routes = 200 combos
    jobs = [(prompts[i % len(prompts)], routes[(i // len(prompts)) % 4]) for i in range(320)]
    expected = {}
    for model, _ in routes:
        outs = offline.generate(
            [chat_prompt(offline.tokenizer, [{"role": "user", "content": p}]) for p in prompts],
            SamplingParams(max_tokens=8, temperature=0),
            lora=model if model != "hylora-demo" else None,
        )
        for p, o in zip(prompts, outs, strict=True):
            expected[(p, model)] = o.text

    async def one(http: httpx.AsyncClient, prompt, model, task):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0, "stream": True}
        if model:
            body["model"] = model
        headers = {"X-Task": task} if task else {}
        text, done = "", False
        async with http.stream("POST", f"{server}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content", "")
        assert done
        return text

    async def main():
        queue = list(enumerate(jobs))
        results = {}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:

            async def client_loop():
                while queue:
                    i, (prompt, (model, task)) = queue.pop()
                    results[i] = await one(http, prompt, model, task)

            await asyncio.gather(*(client_loop() for _ in range(64)))
        return results

    start = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == len(jobs)
    for i, (prompt, (model, task)) in enumerate(jobs):
        assert results[i] == expected[(prompt, model or task)], (i, prompt, model, task)
    print(f"320 streamed requests from 64 clients in {time.monotonic() - start:.1f}s")
    assert metric(server, "hylora_running_requests") == 0


def test_client_disconnect_aborts_and_frees(server):
    body = {
        "model": "relic",
        "messages": [{"role": "user", "content": "Describe."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    before = (
        metric(server, "hylora_requests_total", 'adapter="relic",status="abort"')
        if _has(server, 'hylora_requests_total{adapter="relic",status="abort"}')
        else 0.0
    )
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "content" in line:
                break  # go away mid-stream
    for _ in range(100):
        if metric(server, "hylora_running_requests") == 0 and metric(server, "hylora_kv_pages_used") == 0:
            break
        time.sleep(0.1)
    assert metric(server, "hylora_running_requests") == 0 and metric(server, "hylora_kv_pages_used") == 0
    assert metric(server, "hylora_requests_total", 'adapter="relic",status="abort"') == before + 1


def test_client_that_hangs_up_on_a_non_streaming_request_aborts_it(server):
    """The server sees a non-streaming client's disconnect too (no middleware may hide it): its
    request is aborted and its slot and pages freed, not run to max_tokens for nobody."""
    body = {
        "model": "tomb",
        "messages": [{"role": "user", "content": "Describe."}],
        "n": 16,  # ~30 s of work on the CPU
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    label = 'adapter="tomb",status="abort"'
    seen = _has(server, f"hylora_requests_total{{{label}}}")
    before = metric(server, "hylora_requests_total", label) if seen else 0.0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s and closes its connection
        httpx.post(f"{server}/v1/chat/completions", json=body, timeout=2)
    for _ in range(100):
        if metric(server, "hylora_running_requests") == 0 and metric(server, "hylora_kv_pages_used") == 0:
            break
        time.sleep(0.1)
    assert metric(server, "hylora_running_requests") == 0 and metric(server, "hylora_kv_pages_used") == 0
    assert metric(server, "hylora_requests_total", label) == before + 16


def test_numerical_fault_fails_one_request_and_the_next_is_unaffected(client, server, offline):
    expected = offline_chat(offline, PROMPTS[4], "mural", max_tokens=8, temperature=0)
    with pytest.raises(openai.InternalServerError, match="numerical fault.*'mural'"):
        client.chat.completions.create(
            model="mural",
            messages=[{"role": "user", "content": PROMPTS[4]}],
            max_tokens=8,
            temperature=0,
            extra_body={"hylora_inject_fault": True},
        )
    reply = client.chat.completions.create(
        model="mural", messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == expected.text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_metrics_expose_adapter_residency(server):
    chat = {"model": "relic", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 3}
    assert httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for name in [
        "hylora_requests_total",
        "hylora_prompt_tokens_total",
        "hylora_generation_tokens_total",
        "hylora_time_to_first_token_seconds_bucket",
        "hylora_inter_token_latency_seconds_bucket",
        "hylora_waiting_requests",
        "hylora_kv_pages_total",
        "hylora_state_slots_total",
        "hylora_lora_slots_total",
        "hylora_adapters_on_cpu",
        'hylora_adapter_on_device{adapter="relic"}',
    ]:
        assert name in text, name


def test_an_unloaded_adapter_leaves_the_metrics(server):
    """Runtime adapters come and go: the series of one that was unloaded leave /metrics at the next
    scrape (kept, a scrape grew with every name ever served), the others' stay."""
    name = "passing-through"
    load = {"lora_name": name, "lora_path": "copy_of_relic"}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    for model in (name, "relic"):
        chat = {"model": model, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 3}
        assert httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    label = f'adapter="{name}"'
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for series in ("hylora_requests_total", "hylora_time_to_first_token_seconds_bucket", "hylora_prefix_cache_queried"):
        assert any(line.startswith(series) and label in line for line in text.splitlines()), series
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30).status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert label not in text
    assert 'hylora_requests_total{adapter="relic"' in text or 'adapter="relic",status=' in text


def test_latency_starts_when_the_request_arrives(server):
    """A request whose body takes 0.6 s to upload: its intake's read phase holds those seconds, its TTFT
    counts them (and the rest of its intake), and the engine thread's busy seconds grow."""

    def totals() -> dict[str, float]:
        names = {
            phase: ("hylora_request_intake_seconds_sum", f'phase="{phase}"') for phase in ("read", "prepare", "admit")
        }
        names |= {
            "count": ("hylora_request_intake_seconds_count", 'phase="admit"'),
            "ttft": ("hylora_time_to_first_token_seconds_sum", 'adapter="relic"'),
            "steps": ("hylora_engine_step_seconds", ""),
        }
        found = {}
        for key, (name, labels) in names.items():
            try:
                found[key] = metric(server, name, labels)
            except KeyError:  # no request has been observed yet
                found[key] = 0.0
        return found

    body = json.dumps(
        {"model": "relic", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 2}
    ).encode()

    def slow_upload():
        yield body[:10]
        time.sleep(0.6)
        yield body[10:]

    before = totals()
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/chat/completions", content=slow_upload(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    after = totals()
    grew = {k: after[k] - before[k] for k in after}
    assert grew["count"] == 1
    assert grew["read"] >= 0.6, grew
    assert grew["ttft"] >= grew["read"] + grew["prepare"] + grew["admit"], grew
    assert grew["steps"] > 0, grew


def _has(server, key):
    return key in httpx.get(f"{server}/metrics", timeout=10).text


# --- other server configurations -------------------------------------------------------------


def test_api_key_and_loading_off_without_root(cache_dir, tmp_path):
    with running_server(
        ["--demo", "--api-key", "sekret", "--max-model-len", "256", "--device", "cpu"], cache_dir, tmp_path / "log"
    ) as handle:
        url = handle.url
        body = {"model": "relic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
        wrong = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        assert client.chat.completions.create(**body).choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": "/tmp"},
            headers={"Authorization": "Bearer sekret"},
            timeout=30,
        )
        assert r.status_code == 403 and "--adapter-root" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # health needs no key
        for path in ("/metrics", "/docs", "/openapi.json"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer sekret"}).status_code == 200, path
        spec = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
        body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}  # bodies are documented
        assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    args = ["--demo", "--api-key", "sekret", "--public-metrics", "--max-model-len", "256", "--device", "cpu"]
    with running_server(args, cache_dir, tmp_path / "log2") as handle:
        assert httpx.get(f"{handle.url}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{handle.url}/openapi.json", timeout=10).status_code == 401


def test_readme_curl_example(cache_dir, tmp_path):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    curl = text[text.index("curl http://127.0.0.1:8000") :].split("\n```")[0]
    with running_server(["--demo", "--device", "cpu"], cache_dir, tmp_path / "log") as handle:
        url = handle.url
        out = subprocess.run(
            ["bash", "-c", curl.replace("http://127.0.0.1:8000", url)], capture_output=True, text=True, timeout=120
        )
        reply = json.loads(out.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]


def test_a_many_sequence_request_does_not_starve_a_small_one(cache_dir, tmp_path):
    """A completion of 4 prompts x n=8 (32 sequences) on a server of 2 running sequences: a small chat
    request sent after it is answered long before it ends (the server groups a request's sequences
    and the scheduler shares admission between groups), and both are complete."""
    args = ["--demo", "--max-num-seqs", "2", "--max-model-len", "256", "--dtype", "float32", "--device", "cpu"]
    with running_server(args, cache_dir, tmp_path / "log") as handle:
        url = handle.url
        big = {"model": "relic", "prompt": [f"Item {i}." for i in range(4)], "n": 8, "max_tokens": 32}
        big |= {"temperature": 0, "ignore_eos": True}
        small = {"model": "tomb", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

        async def main():
            async with httpx.AsyncClient(timeout=300) as http:
                t0 = time.monotonic()
                big_task = asyncio.create_task(http.post(f"{url}/v1/completions", json=big))
                while metric(url, "hylora_waiting_requests") < 20:
                    await asyncio.sleep(0.05)  # most of the big one's sequences queued
                reply = await http.post(f"{url}/v1/chat/completions", json=small)
                small_at = time.monotonic() - t0
                response = await big_task
                return reply, response, small_at / (time.monotonic() - t0)

        reply, response, share = asyncio.run(main())
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
        assert response.status_code == 200 and len(response.json()["choices"]) == 32
        assert all(c["finish_reason"] == "length" for c in response.json()["choices"])
        # it took the first place that freed (~1/16 of the way); FCFS would queue it behind 20 or more
        assert share < 0.5, share


DIG_PARAMETERS = {"type": "object", "properties": {"site": {"type": "string"}}, "required": ["site"]}
TOOL = {"type": "function", "function": {"name": "dig", "description": "Dig at a site", "parameters": DIG_PARAMETERS}}
CALLED = [
    {"role": "user", "content": PROMPTS[0]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "dig", "arguments": '{"site": "Giza"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a sealed door"},
]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [TOOL], "tool_choice": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": "The mural shows"}],
         "continue_final_message": True, "add_generation_prompt": False},
        {"messages": CALLED, "tools": [TOOL], "tool_choice": "none"},
    ],
    ids=["tools", "template-kwargs", "continue-final-message", "tool-call-history"],
)  # fmt: skip
def test_tokenize_counts_a_conversation_as_chat_renders_it(server, extra):
    """/tokenize with messages renders what a chat request with the same body would: its count is
    the chat's usage.prompt_tokens (tools, template variables, a continued message, tool turns)."""
    body = {"model": "relic", "messages": [{"role": "user", "content": PROMPTS[1]}]} | extra
    chat = httpx.post(f"{server}/v1/chat/completions", json=body | {"max_tokens": 1}, timeout=60)
    assert chat.status_code == 200, chat.text
    counted = httpx.post(f"{server}/tokenize", json={k: v for k, v in body.items() if k != "tool_choice"}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    plain = httpx.post(f"{server}/tokenize", json={"model": "relic", "messages": body["messages"]}, timeout=30)
    assert plain.json()["count"] != counted.json()["count"]  # each field changes the prompt


def test_tokenize_refuses_what_chat_refuses(server):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    both = httpx.post(f"{server}/tokenize", json={"messages": msgs, "continue_final_message": True}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    bad_tool = httpx.post(f"{server}/tokenize", json={"messages": msgs, "tools": [{"type": "function"}]}, timeout=30)
    assert bad_tool.status_code == 400 and bad_tool.json()["error"]["param"] == "tools", bad_tool.text
    own = httpx.post(f"{server}/tokenize", json={"messages": msgs, "chat_template": "{{ 1 }}"}, timeout=30)
    assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"


def test_a_batch_of_prompts_is_checked_prompt_by_prompt(server, offline):
    """Each prompt of a /v1/completions batch must fit the context, not all of them together."""
    prompt = "The relic was found " * 20
    assert len(offline.tokenizer.encode(prompt)) < 512 - 2
    count = 512 * max_token_chars(offline.tokenizer) // len(prompt) + 1  # together too long for the old summed check
    body = {"model": "relic", "prompt": [prompt] * count, "max_tokens": 1}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == count, r.text


def test_bad_bodies_get_a_message_that_says_what_to_fix(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "relic", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    r = httpx.post(f"{server}/tokenize", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "/tokenize takes text content only, not image_url parts" in r.json()["error"]["message"]

    chat = '{"model": "relic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'
    for raw, why in (
        (chat % ("9" * 5000), "integer with more than 4300 digits"),
        (chat % ("[" * 20_000 + "]" * 20_000), "nests arrays or objects too deeply"),
    ):
        r = httpx.post(
            f"{server}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text[:300]
    probe = {"model": "relic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{server}/v1/chat/completions", json=probe, timeout=60).status_code == 200


def test_vllm_fields_that_would_change_the_output_are_refused_not_ignored(server):
    chat = {"model": "relic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = [("logits_processors", ["x"]), ("echo", True), ("truncate_prompt_tokens", 8), ("use_beam_search", True),
               ("thinking_token_budget", 0), ("thinking_token_budget", 256),
               ("repetition_detection", {"max_pattern_size": 8, "min_count": 3})]  # fmt: skip
    for field, value in refused:
        r = httpx.post(f"{server}/v1/chat/completions", json=chat | {field: value}, timeout=30)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field and "not supported by hylora" in r.json()["error"]["message"]
    asks_nothing = [("allowed_token_ids", []), ("bad_words", None), ("echo", False), ("priority", 3),
                    ("use_beam_search", False), ("thinking_token_budget", None),
                    ("repetition_detection", None)]  # fmt: skip
    for field, value in asks_nothing:
        assert httpx.post(f"{server}/v1/chat/completions", json=chat | {field: value}, timeout=60).status_code == 200


def test_allowed_token_ids_restricts_the_output_as_offline(server, offline):
    """vLLM's allowed_token_ids: every generated token is one of them, sampled or greedy, and the server
    gives the offline engine's tokens; an id outside the vocabulary is a 400."""
    allowed = [offline.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        want = offline_chat(offline, PROMPTS[1], "tomb", max_tokens=6, allowed_token_ids=allowed, **params)
        assert want.token_ids and set(want.token_ids) <= set(allowed)
        body = {"model": "tomb", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 6}
        body |= {"allowed_token_ids": allowed, **params}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
    body = {"model": "tomb", "messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [10**9]}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "allowed_token_ids must be in" in r.json()["error"]["message"]


def test_bad_words_are_never_generated_and_the_rest_is_as_offline(server, offline):
    """vLLM's bad_words: the greedy reply's first word, banned, no longer appears; the server's reply
    equals the offline engine's with the same token sequences."""
    from hylora.tokenizer import bad_words_token_ids

    first = offline_chat(offline, PROMPTS[2], "mural", max_tokens=8, temperature=0)
    word = offline.tokenizer.decode(first.token_ids[:1]).strip() or "x"
    banned = bad_words_token_ids(offline.tokenizer, [word])
    want = offline_chat(offline, PROMPTS[2], "mural", max_tokens=8, temperature=0, bad_words_ids=banned)
    assert want.token_ids[:1] != first.token_ids[:1]
    assert not any(seq == want.token_ids[i : i + len(seq)] for seq in banned for i in range(len(want.token_ids)))
    body = {"model": "mural", "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 8}
    r = httpx.post(f"{server}/v1/chat/completions", json=body | {"temperature": 0, "bad_words": [word]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text


def test_a_text_part_without_string_text_is_a_400(server):
    for part in ({"type": "text"}, {"type": "text", "text": ["a", "b"]}, {"type": "text", "text": 5}):
        body = {"model": "relic", "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "needs a string 'text'" in r.json()["error"]["message"], (part, r.text)


def test_an_adapter_may_not_take_a_name_the_base_model_is_served_under(cache_dir, adapter_root, tmp_path):
    """A second --served-model-name routes to the base model: an adapter loaded under it would be
    listed but never served (the base model would answer in its place)."""
    args = ["--demo", "--served-model-name", "hylora-demo", "alias2", "--adapter-root", str(adapter_root)]
    with running_server([*args, "--max-model-len", "256", "--device", "cpu"], cache_dir, tmp_path / "log") as handle:
        for name in ("alias2", "hylora-demo"):
            body = {"lora_name": name, "lora_path": "copy_of_relic"}
            r = httpx.post(f"{handle.url}/v1/load_lora_adapter", json=body, timeout=60)
            assert r.status_code == 400 and "is the base model's name" in r.json()["error"]["message"], r.text
        names = [m["id"] for m in httpx.get(f"{handle.url}/v1/models", timeout=10).json()["data"]]
        assert names.count("alias2") == 1


def test_tokenize_and_detokenize_refuse_an_unknown_model_as_chat_does(server):
    chat = {"model": "pottery", "messages": [{"role": "user", "content": "hi"}]}
    unknown = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(f"{server}{path}", json=body | {"model": "pottery"}, timeout=30)
        assert r.status_code == 404 and r.json() == unknown.json(), (path, r.text)
        for model in ("relic", "hylora-demo"):
            assert httpx.post(f"{server}{path}", json=body | {"model": model}, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("logit_bias", {"nine": 1}),
        ("logit_bias", {"999999999": 1}),
        ("stop_token_ids", [10**9]),
        ("allowed_token_ids", [10**9]),
        ("n", 0),
        ("max_tokens", 0),
        ("seed", 2**64),
    ],
)
def test_out_of_range_sampling_values_name_their_param(server, field, value):
    """As OpenAI's errors: `param` is the field at fault."""
    body = {"model": "relic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | {field: value}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_request_bodies_with_invalid_unicode_anywhere_are_refused_and_big_clean_ones_validate():
    """The body check walks dicts and short lists itself and hands long lists to json.dumps: a lone
    surrogate is caught on either path, in a value or a key; valid non-ASCII text and a 5 MB frame-list URL
    pass."""
    from pydantic import ValidationError

    from hylora.server.protocol import ChatCompletionRequest, CompletionRequest

    def chat(content, **extra):
        return {"model": "relic", "messages": [{"role": "user", "content": content}], **extra}

    frames = "data:video/jpeg;base64," + ",".join(["QUJD" * 65_000] * 20)
    ok = [
        chat("café, 東京, 🎥"),
        chat([{"type": "video_url", "video_url": {"url": frames}}, {"type": "text", "text": "what is shown?"}]),
        {"prompt": list(range(5000)), "max_tokens": 2},
        {"prompt": "x", "max_tokens": 2, "extra": ["é"] * 100},
    ]
    for body in ok:
        (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    bad = [
        chat("a\ud800b"),
        chat([{"type": "text", "text": "\udfff"}]),
        {"prompt": "x", "stop": ["\ud83d"], "max_tokens": 2},  # a short list: walked
        {"prompt": "x", "max_tokens": 2, "extra": ["é"] * 100 + ["\ud83d"]},  # a long one: json.dumps
        {"prompt": "x", "max_tokens": 2, "extra": {"\ud800": 1}},  # a key
        {"prompt": "x", "max_tokens": 2, "extra": [[["deep \udc80"]]]},
    ]
    for body in bad:
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        with pytest.raises(ValidationError, match="invalid Unicode"):
            model.model_validate(body)


@pytest.mark.parametrize("key", [" 5 ", "5_0", "٥", "+5", "0x5", ""])
def test_logit_bias_keys_are_decimal_token_ids(key):
    """int() reads these too ("5_0" as 50, Arabic-Indic "٥" as 5): refused instead, naming the field."""
    from hylora.server.protocol import ChatCompletionRequest, Unsupported

    def bias(key):
        body = {"model": "relic", "messages": [{"role": "user", "content": "x"}], "logit_bias": {key: 1.0}}
        return ChatCompletionRequest.model_validate(body).sampling_params(8, None, None).logit_bias

    assert bias("50") == {50: 1.0}
    with pytest.raises(Unsupported, match="decimal digits") as e:
        bias(key)
    assert e.value.param == "logit_bias"
