"""Drop-in for vLLM users: structured outputs through the official `openai` client, generation
defaults from the model, the flags of vLLM's launch scripts, /tokenize, /detokenize, /version and
the request fields vLLM users send."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import jsonschema
import openai
import pytest

from hylora.server.serve import add_serve_args
from tests.server_helpers import running_server

SCHEMAS = {
    "relic": {
        "type": "object",
        "properties": {
            "type": {"enum": ["vessel", "disc", "figure"]},
            "period": {"type": "string", "maxLength": 12},
            "material": {"enum": ["bronze", "jade", "ceramic"]},
            "findings": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "where": {"type": "string", "maxLength": 8},
                        "count": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["where", "count"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["type", "period", "material", "findings"],
        "additionalProperties": False,
    },
    "tomb": {
        "type": "object",
        "properties": {
            "chambers": {"type": "integer", "minimum": 1, "maximum": 9},
            "entrance": {"enum": ["north", "south", "east", "west"]},
            "layout": {
                "type": "object",
                "properties": {"ramp": {"type": "boolean"}, "vaulted": {"type": "boolean"}},
                "required": ["ramp", "vaulted"],
                "additionalProperties": False,
            },
        },
        "required": ["chambers", "entrance", "layout"],
        "additionalProperties": False,
    },
    "mural": {
        "type": "object",
        "properties": {
            "pigments": {
                "type": "array",
                "items": {"enum": ["ochre", "malachite", "azurite", "carbon"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "flaking": {"type": "boolean"},
        },
        "required": ["pigments", "flaking"],
        "additionalProperties": False,
    },
}
PLAIN = {"messages": [{"role": "user", "content": "Where is the entrance?"}], "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def server(demo_cache_dir, tmp_path_factory):
    args = ["--demo", "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"]
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield handle


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def _ask_json(client, model: str | None, name: str, stream: bool) -> tuple[str, str | None]:
    messages = [{"role": "user", "content": f"Describe the {name} as JSON."}]
    kwargs = dict(model=model or "hylora-demo", messages=messages, max_tokens=300, response_format=_schema_format(name))
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_json_schema_outputs_validate_streamed_and_not_with_adapters_and_base_mixed(client):
    """Random weights: only the grammar makes these documents valid. Six requests run at once."""
    cases = [(model, name, stream) for model, name in [("relic", "relic"), ("tomb", "tomb"), (None, "mural")]
             for stream in (False, True)]  # fmt: skip
    results: dict = {}

    def run(i, case):
        results[i] = _ask_json(client, *case)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, (_, name, _) in enumerate(cases):
        text, finish = results[i]
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_regex_choice_and_completions(client, server):
    reply = client.chat.completions.create(
        model="hylora-demo",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    body = {"model": "tomb", "prompt": "The tomb", "max_tokens": 20, "temperature": 0.8, "seed": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body | {"guided_regex": "[a-z]{3,6}-[0-9]{2}"}, timeout=60)
    import re

    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", r.json()["choices"][0]["text"]), r.json()
    r = httpx.post(f"{server.url}/v1/completions", json=body | {"guided_choice": ["north", "south"]}, timeout=60)
    assert r.json()["choices"][0]["text"] in ("north", "south")
    r = httpx.post(
        f"{server.url}/v1/completions", json=body | {"structured_outputs": {"choice": ["ramp", "shaft"]}}, timeout=60
    )
    assert r.json()["choices"][0]["text"] in ("ramp", "shaft")


def test_max_tokens_cutting_a_document_says_length(client):
    reply = client.chat.completions.create(
        model="relic",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        response_format=_schema_format("relic"),
    )
    assert reply.choices[0].finish_reason == "length"


def test_grammar_request_beside_plain_requests_changes_nothing(server):
    alone = httpx.post(f"{server.url}/v1/chat/completions", json=PLAIN | {"model": "mural"}, timeout=60).json()
    results: dict = {}

    def grammar():
        body = {"model": "relic", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200}
        results["g"] = httpx.post(
            f"{server.url}/v1/chat/completions", json=body | {"response_format": _schema_format("tomb")}, timeout=120
        )

    def plain():
        results["p"] = httpx.post(f"{server.url}/v1/chat/completions", json=PLAIN | {"model": "mural"}, timeout=60)

    threads = [threading.Thread(target=grammar), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results["p"].json()["choices"] == alone["choices"]
    jsonschema.validate(json.loads(results["g"].json()["choices"][0]["message"]["content"]), SCHEMAS["tomb"])


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}, "then": {}}}}},
         "cannot compile"),
        ({"guided_regex": "(?<=a)b"}, "regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "set only one output constraint"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)  # fmt: skip
def test_uncompilable_or_conflicting_constraints_are_400(server, fields, needle):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=PLAIN | {"model": "relic"} | fields, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_request_fields_vllm_users_send(client, server):
    url = server.url
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Describe the relic."}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    chat_tok = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    detok = httpx.post(f"{url}/detokenize", json={"tokens": chat_tok["tokens"]}, timeout=30).json()
    assert detok["prompt"].startswith("<|im_start|>user\nhi")
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=30).status_code == 400
    assert httpx.get(f"{url}/version", timeout=30).json()["version"]
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert models["relic"]["parent"] == "hylora-demo" and models["relic"]["max_model_len"] == 512

    base = dict(model="relic", messages=[{"role": "user", "content": "Describe."}], temperature=0)
    free = client.chat.completions.create(**base, max_completion_tokens=8)
    assert free.usage.completion_tokens == 8
    first = free.choices[0].message.content
    # a +100 bias forces one token everywhere; min_tokens keeps EOS away for that many tokens
    forced_id = httpx.post(f"{url}/tokenize", json={"prompt": " tomb", "add_special_tokens": False}).json()["tokens"][0]
    biased = client.chat.completions.create(**base, max_tokens=4, logit_bias={str(forced_id): 100})
    assert biased.choices[0].message.content == " tomb" * 4
    eos_first = client.chat.completions.create(**base, max_tokens=20, logit_bias={"0": -100}, extra_body={})
    assert eos_first.choices[0].finish_reason in ("stop", "length")
    im_end = httpx.post(f"{url}/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"][0]
    stopper = {str(im_end): 100}
    assert client.chat.completions.create(**base, max_tokens=10, logit_bias=stopper).usage.completion_tokens == 1
    held = client.chat.completions.create(**base, max_tokens=10, logit_bias=stopper, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens >= 5
    stop_text = first[2:5]
    kept = client.chat.completions.create(
        **base, max_tokens=8, stop=[stop_text], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content.endswith(stop_text)
    chunks = list(
        client.chat.completions.create(**base, max_tokens=5, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.completion_tokens == 5


def test_generation_config_defaults_apply_when_a_request_sets_nothing(demo_dir, demo_cache_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(demo_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0, "top_k": 1}))
    # the served name is the model argument exactly as given (vLLM's rule)
    body = {"model": str(model), "messages": [{"role": "user", "content": "Describe the relic."}], "max_tokens": 12}
    with running_server([str(model), "--device", "cpu", "--max-model-len", "256"], demo_cache_dir, tmp_path / "a") as s:
        greedy = httpx.post(f"{s.url}/v1/chat/completions", json=body | {"temperature": 0}, timeout=60).json()
        unset = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
        own = [
            httpx.post(f"{s.url}/v1/chat/completions", json=body | {"temperature": 1.5, "top_k": 0, "seed": i}).json()
            for i in range(2)
        ]
        assert "temperature': 0.0" in s.log_path.read_text()  # the server says which defaults apply
    texts = {r["choices"][0]["message"]["content"] for r in unset}
    assert texts == {greedy["choices"][0]["message"]["content"]}  # the model's defaults: greedy
    assert own[0]["choices"][0]["message"]["content"] != own[1]["choices"][0]["message"]["content"]
    with running_server(
        [str(model), "--device", "cpu", "--max-model-len", "256", "--generation-config", "vllm", "--seed", "7"],
        demo_cache_dir,
        tmp_path / "b",
    ) as s:
        sampled = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
    assert sampled[0]["choices"][0]["message"]["content"] != greedy["choices"][0]["message"]["content"]


# vLLM's documented launch lines (LoRA serving and the OpenAI-compatible server docs), `vllm serve`
# replaced; MODEL and adapter paths are filled in with the demo's.
VLLM_LAUNCH_LINES = [
    "serve MODEL --enable-lora --lora-modules sql-lora=ADAPTER",
    'serve MODEL --enable-lora --lora-modules \'{"name": "sql-lora", "path": "ADAPTER", "base_model_name": "MODEL"}\'',
    "serve MODEL --dtype auto --api-key token-abc123",
    "serve MODEL --enable-lora --max-lora-rank 64 --max-loras 2 --max-cpu-loras 4 --lora-modules a=ADAPTER b=ADAPTER",
    "serve MODEL --trust-remote-code --tensor-parallel-size 1 --gpu-memory-utilization 0.9 --max-model-len 512 "
    "--served-model-name demo --seed 0 --generation-config auto --uvicorn-log-level warning --disable-log-requests",
    "serve MODEL --chat-template TEMPLATE --enable-lora --lora-modules sql-lora=ADAPTER",
]


def test_vllm_launch_lines_parse_and_start(demo_dir, demo_cache_dir, tmp_path):
    import argparse
    import shlex

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    lines = [
        line.replace("MODEL", str(demo_dir)).replace("ADAPTER", str(demo_dir / "adapters" / "relic"))
        .replace("TEMPLATE", str(template))
        for line in VLLM_LAUNCH_LINES
    ]  # fmt: skip
    for line in lines:
        parser.parse_args(shlex.split(line)[1:])  # every flag known
    with pytest.raises(SystemExit):
        parser.parse_args([str(demo_dir), "--enable-prefix-cachingg"])  # unknown flags still fail loudly
    with running_server(shlex.split(lines[1])[1:] + ["--device", "cpu"], demo_cache_dir, tmp_path / "log") as s:
        models = {m["id"] for m in httpx.get(f"{s.url}/v1/models", timeout=30).json()["data"]}
        assert "sql-lora" in models
        r = httpx.post(f"{s.url}/v1/chat/completions", json=PLAIN | {"model": "sql-lora"}, timeout=60)
        assert r.status_code == 200
    help_text = parser.format_help()
    for flag in ("--enable-lora", "--trust-remote-code", "--tensor-parallel-size"):
        assert flag in help_text


def test_launch_flags_that_would_break_every_request_stop_the_start(tmp_path, capsys, demo_cache_dir, monkeypatch):
    """Flags whose mistake used to show only in requests (or never) are refused at start: a chat
    template file that does not exist (its path was served as the template), a template that does not
    parse, an empty --api-key (it turned authentication off), an adapter name given twice (the last
    won), a port past 65535 (bound modulo 65536), a stall timeout of 0 (every stream cut)."""
    import argparse

    from hylora.server.serve import build_state, chat_template, lora_modules

    with pytest.raises(ValueError, match="no such file"):
        chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        chat_template("{% for x in %}")
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template(str(good)) == good.read_text() and chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="names 'x' twice"):
        lora_modules(["x=/a", '{"name": "x", "path": "/b"}'], "base")
    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    with pytest.raises(ValueError, match="--api-key is empty"):
        build_state(parser.parse_args(["--demo", "--api-key", ""]))
    with pytest.raises(ValueError, match="temperature must be a number"):  # not every request's 400 on its own field
        build_state(parser.parse_args(["--demo", "--override-generation-config", '{"temperature": "hot"}']))
    with pytest.raises(ValueError, match="device 'banana'"):
        build_state(parser.parse_args(["--demo", "--device", "banana"]))
    for flags in (["--port", "99999"], ["--stream-stall-timeout", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--demo", *flags])
        assert flags[0] in capsys.readouterr().err


def test_sizes_the_model_or_the_machine_cannot_serve_stop_the_start(demo_cache_dir, monkeypatch, capsys):
    """Sizes that were accepted and then served wrongly or crashed: --max-model-len past the model's
    max_position_embeddings (untrained positions, vLLM refuses), --page-size and --block-size both (one
    silently won), fewer CPU adapter copies than device slots, a zero body limit (every request a 413),
    and a KV cache larger than the machine (the allocator's error, or the OOM killer later)."""
    import argparse

    from hylora.engine import EngineConfig
    from hylora.engine.memory import CacheSizeError
    from hylora.server.serve import build_state

    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    monkeypatch.delenv("HYLORA_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cpu = ["--demo", "--device", "cpu", "--dtype", "float32"]
    with pytest.raises(ValueError, match=r"max_position_embeddings \(32768"):
        build_state(parser.parse_args([*cpu, "--max-model-len", "32769"]))
    EngineConfig(max_model_len=32768).check_context(32768)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's escape hatch, as vLLM reads it
    EngineConfig(max_model_len=32769).check_context(32768)
    with pytest.raises(ValueError, match="--page-size 32 and --block-size 16"):
        build_state(parser.parse_args([*cpu, "--page-size", "32", "--block-size", "16"]))
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        build_state(parser.parse_args([*cpu, "--max-loras", "2", "--max-cpu-loras", "1"]))
    with pytest.raises(CacheSizeError, match="more than this machine's available memory.*lower --num-pages"):
        build_state(parser.parse_args([*cpu, "--num-pages", str(10**9)]))
    with pytest.raises(SystemExit):
        parser.parse_args([*cpu, "--max-body-bytes", "0"])
    assert "--max-body-bytes" in capsys.readouterr().err
    engine = build_state(parser.parse_args([*cpu, "--max-model-len", "256", "--block-size", "32"])).aengine.engine
    assert engine.config.page_size == 32 and engine.kv.page_size == 32


def test_tensor_parallel_above_one_is_refused_with_a_pointer(demo_cache_dir, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hylora", "serve", "--demo", "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HYLORA_CACHE_DIR": str(demo_cache_dir), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2 and "--replicas" in out.stderr


def test_a_preprocessing_default_no_request_could_use_stops_the_start(demo_cache_dir):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hylora", "serve", "--demo", "--device", "cpu", "--mm-processor-kwargs", '{"fps": 999}'],
        capture_output=True,
        text=True,
        timeout=300,
        env={"HYLORA_CACHE_DIR": str(demo_cache_dir), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2 and "--mm-processor-kwargs / --media-io-kwargs: fps must be" in out.stderr


# The Qwen3.5 / Qwen3.6 recipe's launch line, `vllm serve` replaced (issue 24)
RECIPE = (
    "serve --model MODEL --served-model-name qwen3.6 qwen -tp 1 --reasoning-parser qwen3 --enable-auto-tool-choice "
    "--tool-call-parser qwen3_coder --enable-prefix-caching --speculative-config "
    '\'{"method": "mtp", "num_speculative_tokens": 2}\' --default-chat-template-kwargs \'{"enable_thinking": false}\' '
    "--disable-log-stats --enable-log-requests --max-logprobs 5 --block-size 32 --enable-chunked-prefill "
    "--kv-cache-dtype auto --mamba-ssm-cache-dtype float32 --mamba-cache-mode align "
    "--allowed-origins '[\"http://dash.example\"]' --dtype half --limit-mm-per-prompt image=2,video=1 "
    "--max-model-len 512"
)


def test_the_qwen_recipe_launch_line_runs_unchanged(demo_dir, demo_cache_dir, tmp_path):
    import shlex

    args = shlex.split(RECIPE.replace("MODEL", str(demo_dir)))[1:]
    args[args.index("half")] = "float32"  # the CPU runs fp32; --dtype half itself is checked below
    with running_server([*args, "--device", "cpu"], demo_cache_dir, tmp_path / "log") as s:
        log = s.log_path.read_text()
        assert "--disable-log-stats: accepted, no effect" in log  # accepted flags that change nothing say so
        assert "--mamba-cache-mode / --mamba-block-size: accepted, no effect" in log
        cards = httpx.get(f"{s.url}/v1/models", timeout=30).json()["data"]
        assert [c["id"] for c in cards][:2] == ["qwen3.6", "qwen"]  # every served name, the first reported
        card = httpx.get(f"{s.url}/v1/models/qwen", timeout=30).json()
        assert card["id"] == "qwen" and card["max_model_len"] == 512
        assert httpx.get(f"{s.url}/v1/models/nope", timeout=30).status_code == 404
        body = PLAIN | {"model": "qwen", "user": "alice"}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "qwen"  # the name the client asked for
        assert r.json()["choices"][0]["message"]["reasoning_content"] is None  # thinking off by default here
        r = httpx.post(f"{s.url}/v1/chat/completions", json=PLAIN | {"logprobs": True, "top_logprobs": 6}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"  # --max-logprobs 5
        drafts = [line for line in httpx.get(f"{s.url}/metrics", timeout=30).text.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total{")]  # fmt: skip
        assert drafts and float(drafts[0].split()[-1]) > 0  # MTP speculation ran (the demo's draft layer)
        preflight = httpx.options(
            f"{s.url}/v1/chat/completions",
            headers={"Origin": "http://dash.example", "Access-Control-Request-Method": "POST"},
            timeout=30,
        )
        assert preflight.headers.get("access-control-allow-origin") == "http://dash.example"


def test_language_model_only_serves_text_and_refuses_media(demo_dir, demo_cache_dir, tmp_path):
    """vLLM's --language-model-only (text-only Qwen3.6 recipes): the tower is not loaded, text answers
    are the full model's, an image is a 400 that names the flag."""
    from hylora.engine import EngineConfig, LLMEngine, SamplingParams
    from hylora.tokenizer import chat_prompt

    config = dict(device="cpu", dtype="float32", max_model_len=256)
    text_only = LLMEngine(demo_dir, EngineConfig(language_model_only=True, **config), progress=False)
    full = LLMEngine(demo_dir, EngineConfig(**config), progress=False)
    assert text_only.model.visual is None and full.model.visual is not None
    ids = chat_prompt(full.tokenizer, PLAIN["messages"])
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    served, expected = (_run_one(e, ids, params) for e in (text_only, full))
    assert served.token_ids == expected.token_ids and served.logprobs == expected.logprobs
    args = ["--demo", "--device", "cpu", "--max-model-len", "256", "--language-model-only"]
    with running_server(args, demo_cache_dir, tmp_path / "log") as s:
        assert httpx.post(f"{s.url}/v1/chat/completions", json=PLAIN, timeout=60).status_code == 200
        image = {"type": "image_url", "image_url": {"url": "file:///nowhere.png"}}
        body = PLAIN | {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--language-model-only" in r.json()["error"]["message"]


def _run_one(engine, ids, params):
    engine.add_request("one", ids, params)
    while True:
        for out in engine.step():
            if out.finished:
                return out


def test_launch_flag_spellings_and_refusals(demo_dir, tmp_path):
    import argparse

    from hylora.server.vllm_flags import normalise_vllm_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)

    def normalised(*argv):
        return normalise_vllm_args(parser.parse_args(list(argv)))

    args = normalised("--model", str(demo_dir), "--dtype", "half", "--block-size", "32", "--limit-mm-per-prompt",
                      "image=2,video=1")  # fmt: skip
    assert (args.model_dir, args.dtype, args.page_size) == (str(demo_dir), "float16", 32)
    assert args.limit_mm_per_prompt == {"image": 2, "video": 1}
    assert normalised("--demo", "--limit-mm-per-prompt", '{"image": 3}').limit_mm_per_prompt == {"image": 3}
    with pytest.raises(ValueError, match="huggingface-cli download Qwen/Qwen3.6-27B"):
        normalised("Qwen/Qwen3.6-27B")  # a Hub id: say how to get it
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        normalised("--demo", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 9}')
    with pytest.raises(ValueError, match="method must be one of"):
        normalised("--demo", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="draft_sample_method"):
        normalised("--demo", "--speculative-config", '{"method": "mtp", "draft_sample_method": "probabilistic"}')
    assert normalised("--demo", "--speculative-config", '{"method": "mtp"}').speculative_config == {
        "method": "mtp", "num_speculative_tokens": 1}  # fmt: skip
    with pytest.raises(ValueError, match="--tool-call-parser"):
        normalised("--demo", "--enable-auto-tool-choice")
    xml = normalised("--demo", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml")
    assert xml.tool_call_parser == "qwen3_coder"  # vLLM's other parser of Qwen's XML calls
    with pytest.raises(ValueError, match="chat_template"):
        normalised("--demo", "--default-chat-template-kwargs", '{"chat_template": "x"}')
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo", "--kv-cache-dtype", "fp8"])  # only auto
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo", "--mamba-ssm-cache-dtype", "bfloat16"])  # the GDN state is float32


def test_vllm_spellings_of_flag_names_sizes_and_graph_switches(demo_dir, capsys, monkeypatch):
    """What vLLM's own parser reads and argparse would not: `--max_model_len` (underscores), the short
    `-sc` / `-cc` / `-ac` (dotted too), `key+ a,b`, sizes `2k` / `2K` and `auto`; `-O0` and cudagraph_mode
    NONE turn CUDA graphs off (as --enforce-eager); a size that is no count stops the start with one line."""
    import argparse

    from hylora.cli import main
    from hylora.server.serve import DrainingServer, build_state
    from hylora.server.vllm_argv import vllm_argv
    from hylora.server.vllm_flags import inactive_flags, normalise_vllm_args

    argv = vllm_argv(["--demo", "--max_model_len=2k", "--max_num_batched_tokens", "1K", "-sc.method", "mtp",
                      "-sc.num_speculative_tokens=2", "-cc.custom_ops+", "-quant,+rms", "-ac", '{"backend": "x"}',
                      "--limit_mm_per_prompt.video", "0", "--hf-overrides.text_config.rope_theta", "1M",
                      "--kernels", "lora_delta_first_from=0"])  # fmt: skip
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = normalise_vllm_args(parser.parse_args(argv))
    assert (args.max_model_len, args.max_num_batched_tokens) == (2000, 1024)
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.compilation_config == {"custom_ops": ["-quant", "+rms"]} and args.attention_config == {"backend": "x"}
    assert args.limit_mm_per_prompt == {"video": 0} and args.hf_overrides == {"text_config": {"rope_theta": 1 << 20}}
    assert args.kernels == {"lora_delta_first_from": 0}  # values keep their underscores
    assert not args.enforce_eager and "--attention-config: accepted, no effect" in " ".join(inactive_flags(args))
    graph_switches = [
        ["-O0"],
        ["-O", "0"],
        ["-cc.cudagraph_mode=NONE"],
        ["--compilation-config", '{"cudagraph_mode": 0}'],
    ]
    for graphs_off in graph_switches:
        args = normalise_vllm_args(parser.parse_args(vllm_argv(["--demo", *graphs_off])))
        assert args.enforce_eager, graphs_off
        assert not any(n.startswith("--optimization-level") for n in inactive_flags(args))
    graphs_on = vllm_argv(["--demo", "-O3", "-cc.cudagraph_mode", "FULL"])
    assert not normalise_vllm_args(parser.parse_args(graphs_on)).enforce_eager

    # auto: the model's own context (the demo's config.json), through the engine the server builds
    args = normalise_vllm_args(parser.parse_args(vllm_argv(["--demo", "--max-model-len", "auto", "--device", "cpu",
                                                            "--max-num-seqs", "2", "--dtype", "float32"])))  # fmt: skip
    state = build_state(args)
    context = json.loads((demo_dir / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert state.engine.config.max_model_len == context

    monkeypatch.setattr(DrainingServer, "run", lambda self: pytest.fail("a refused launch started serving"))
    for flags, message in [(["--max-model-len", "2.5K"], "no decimals with the binary suffix K"),
                           (["--max-num-batched-tokens", "lots"], "'lots' is not a count")]:  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            main(["serve", "--demo", "--device", "cpu", *flags])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and "Traceback" not in err, (flags, err)


def test_a_vllm_flag_hylora_lacks_stops_the_start_pointing_at_the_list(capsys, monkeypatch):
    from hylora.cli import main
    from hylora.server.serve import DrainingServer

    monkeypatch.setattr(DrainingServer, "run", lambda self: pytest.fail("a refused launch started serving"))
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--demo", "--device", "cpu", "--enable-sleep-mode"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unrecognized arguments: --enable-sleep-mode" in err
    assert "`hylora serve --help` lists the flags" in err and "docs/SERVING.md" in err


def test_max_model_len_auto_shortens_to_what_the_memory_holds(demo_dir, monkeypatch):
    """`--max-model-len auto` where the model's whole context does not fit: the longest that does, whole pages,
    and a prompt past it refused as any too-long prompt (on the CPU: max_num_seqs sequences in half the memory)."""
    from hylora.engine import EngineConfig, LLMEngine, SamplingParams, memory
    from hylora.engine.config import AUTO
    from hylora.engine.errors import RequestError

    seqs, pages = 2, 24
    probe = LLMEngine(demo_dir, EngineConfig(max_model_len=64, max_num_seqs=seqs, device="cpu", dtype="float32"),
                      progress=False)  # fmt: skip
    page_bytes = memory._page_bytes(probe.model, probe.config.page_size)
    plan = memory.plan_caches(probe.model, probe.config)
    states = (plan.num_slots + plan.num_snapshots) * memory._state_bytes_per_slot(probe.model)
    del probe
    monkeypatch.setattr(memory, "_host_available_bytes", lambda: 2 * (states + seqs * pages * page_bytes + 100))
    engine = LLMEngine(demo_dir, EngineConfig(max_model_len=AUTO, max_num_seqs=seqs, device="cpu", dtype="float32"),
                       progress=False)  # fmt: skip
    page_size = engine.config.page_size
    assert engine.config.max_model_len == pages * page_size and engine.kv.num_pages >= seqs * pages
    fits = list(range(5, 5 + pages * page_size - 8))
    assert _run_one(engine, fits, SamplingParams(max_tokens=4, temperature=0)).finished
    with pytest.raises(RequestError, match=str(pages * page_size)):
        engine.add_request("long", list(range(5, 5 + pages * page_size + 1)), SamplingParams(max_tokens=1))


def test_max_model_len_auto_on_a_gpu_takes_the_pages_the_budget_leaves(monkeypatch):
    """The GPU's plan (its memory calls stood in for): with auto, a context the budget cannot hold becomes the
    whole pages it can, and every page of the budget is still planned; without auto the same is refused."""
    from types import SimpleNamespace

    import torch

    from hylora.engine import EngineConfig, memory

    gib = 1 << 30
    page, state = 4 << 20, 100 << 20  # bytes a page, a GDN state slot
    cuda = SimpleNamespace(synchronize=lambda dev: None, empty_cache=lambda: None,
                           mem_get_info=lambda dev: (70 * gib, 80 * gib))  # 10 GiB in use: the weights  # fmt: skip
    monkeypatch.setattr(memory.torch, "cuda", cuda)
    for name, value in (("_profile_step", 2 * gib), ("_profile_tower", 0)):
        monkeypatch.setattr(memory, name, lambda model, config, value=value: value)
    monkeypatch.setattr(memory, "_state_bytes_per_slot", lambda model: state)
    monkeypatch.setattr(memory, "_page_bytes", lambda model, page_size: page)
    model = SimpleNamespace(device=torch.device("cuda"), visual=None)
    config = EngineConfig(max_model_len=262144, max_num_seqs=4, gpu_memory_utilization=0.5, enable_prefix_caching=False)
    budget = 40 * gib - 10 * gib - 2 * gib - 4 * state  # 0.5 x 80 GiB - in use - activations - 4 states
    plan = memory.plan_caches(model, config, shorten_to_fit=True)
    assert plan.num_pages == budget // page and plan.max_model_len == plan.num_pages * config.page_size < 262144
    with pytest.raises(memory.CacheSizeError, match="one 262144-token sequence"):
        memory.plan_caches(model, config)
    small = EngineConfig(max_model_len=32768, max_num_seqs=4, gpu_memory_utilization=0.5, enable_prefix_caching=False)
    assert memory.plan_caches(model, small, shorten_to_fit=True).max_model_len is None  # it fits: as asked


def test_batched_and_echo_completions(client):
    """A list of prompts gives one choice set per prompt, `index` in order, each equal to that prompt
    sent alone; echo with max_tokens 0 scores a prompt (lm-evaluation-harness' loglikelihood)."""
    prompts = ["The relic is", "The tomb has", "The mural on"]
    batch = client.completions.create(model="relic", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, text in enumerate(prompts):
        alone = client.completions.create(model="relic", prompt=text, max_tokens=5, temperature=0)
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
    ids = client.completions.create(model="relic", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    scored = client.completions.create(model="relic", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    for text, choice in zip(prompts, scored.choices, strict=True):
        assert choice.text == text and choice.finish_reason == "length"
        lp = choice.logprobs
        assert "".join(lp.tokens) == text and lp.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0


# A Qwen3.6 multimodal launch line as users write it for vLLM: single-GPU no-ops, the dotted JSON spelling,
# and the HTTP flags
RECIPE_MM = (
    "serve MODEL --mm-encoder-tp-mode data --mm-processor-cache-type shm --skip-mm-profiling --async-scheduling "
    '--enable-expert-parallel --disable-custom-all-reduce --compilation-config \'{"cudagraph_mode": "FULL"}\' '
    "--limit-mm-per-prompt.video 0 --limit-mm-per-prompt.image 2 --default-chat-template-kwargs.enable_thinking "
    "false --load-format safetensors --tokenizer-mode auto -dp 1 --disable-fastapi-docs --disable-uvicorn-access-log "
    "--root-path /llm --return-tokens-as-token-ids --enable-force-include-usage --enable-request-id-headers "
    "--max-model-len 512"
)


def test_the_multimodal_launch_line_runs_and_says_what_does_nothing(demo_dir, demo_cache_dir, tmp_path):
    import shlex

    args = shlex.split(RECIPE_MM.replace("MODEL", str(demo_dir)))[1:]
    with running_server([*args, "--device", "cpu", "--dtype", "float32"], demo_cache_dir, tmp_path / "log") as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=PLAIN | {"logprobs": True}, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"].get("reasoning_content") is None
        tokens = [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]
        assert tokens and all(t.startswith("token_id:") for t in tokens)  # --return-tokens-as-token-ids
        assert len(r.headers["x-request-id"]) == 32  # --enable-request-id-headers: a fresh id
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=PLAIN | {"stream": True},
                          headers={"X-Request-Id": "trace-7"}, timeout=60) as stream:  # fmt: skip
            assert stream.headers["x-request-id"] == "trace-7"  # the client's own, on a stream too
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] > 0  # forced usage
        video = {"type": "video_url", "video_url": {"url": "file:///nowhere.mp4"}}
        body = PLAIN | {"messages": [{"role": "user", "content": [video, {"type": "text", "text": "What?"}]}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "video" in r.json()["error"]["message"]  # --limit-mm-per-prompt.video 0
        assert httpx.get(f"{s.url}/openapi.json", timeout=30).status_code == 404  # --disable-fastapi-docs
        log = s.log_path.read_text()
        for flag in ("--mm-encoder-tp-mode", "--mm-processor-cache-type", "--skip-mm-profiling",
                     "--enable-expert-parallel", "--disable-custom-all-reduce", "--compilation-config"):  # fmt: skip
            assert f"{flag}: accepted, no effect" in log, flag
        assert '"POST /v1/chat/completions HTTP/1.1" 200' not in log  # --disable-uvicorn-access-log


def test_dotted_json_flags_and_the_parallel_and_http_refusals(demo_dir, tmp_path, capsys, monkeypatch):
    """vLLM's `--flag.key value` is the flag with a JSON object (merged over one given whole); more than one
    GPU's worth of parallelism, --hf-overrides the model cannot serve (they do reach its config) and broken
    HTTPS settings stop the start with one line."""
    from hylora.cli import main
    from hylora.server.serve import DrainingServer
    from hylora.server.vllm_argv import expand_dotted_args

    argv = ["--speculative-config", '{"method": "mtp"}', "--speculative-config.num_speculative_tokens", "2",
            "--compilation-config.sizes+", "8", "--compilation-config.sizes+=16", "--mm-processor-kwargs.fps", "1.5",
            "--limit-mm-per-prompt", "image=2", "--other.key", "x"]  # fmt: skip
    out = expand_dotted_args(argv)
    assert json.loads(out[out.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert json.loads(out[out.index("--compilation-config") + 1]) == {"sizes": ["8", "16"]}  # vLLM's: strings
    assert json.loads(out[out.index("--mm-processor-kwargs") + 1]) == {"fps": 1.5}
    assert out[-4:] == ["--limit-mm-per-prompt", "image=2", "--other.key", "x"]  # not JSON, not a JSON flag: as given
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    refusals = [
        (["--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens", "9"], "in [1, 4]"),
        (["-dp", "2"], "--data-parallel-size 2: hylora runs one engine per GPU"),
        (["--pipeline-parallel-size", "2"], "--replicas"),
        (["--tensor-parallel-size", "2"], "--replicas"),
        (["--hf-overrides.text_config.max_position_embeddings", "4096"], "max_position_embeddings (4096, config"),
        (["--hf-overrides.text_config.rope_parameters.rope_type", "longrope"], "rope_type 'longrope' is not"),
        (["--hf-overrides.rope_parameters.rope_type", "yarn"], '{"text_config": {"rope_parameters": ...}}'),
        (["--hf-overrides", "[1]"], "--hf-overrides expects a JSON object"),
        (["--ssl-keyfile", str(key)], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], f"--ssl-certfile {cert}: no such file"),
        (["--root-path", "llm"], "must start with '/'"),
        (["--speculative-config.method"], "needs a value"),
    ]
    monkeypatch.setattr(DrainingServer, "run", lambda self: pytest.fail("a refused launch started serving"))
    for flags, message in refusals:
        with pytest.raises(SystemExit) as stop:
            main(["serve", "--demo", "--device", "cpu", *flags])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
