"""Issue 22: one crafted request can only ever fail itself. Each class of hostile request runs
beside a streaming neighbour on an adapter and a non-streaming one with an image; the offender gets
its 4xx promptly, the neighbours' outputs equal a run without it, /health answers within 1 s
throughout, and a fresh text request sent during the attack is not delayed by more than 1 s."""

from __future__ import annotations

import base64
import shutil
import time
from collections.abc import Callable

import httpx
import pytest

from tests.hostile_helpers import Watch, assert_error, neighbour_bodies, run_neighbours, slowest_health_during
from tests.media_helpers import HostileServer, hostile_gif, ico_wrapping, png_header_bomb
from tests.server_helpers import metric, running_server

MAX_MODEL_LEN = 512
NEIGHBOUR_TOKENS = 96


@pytest.fixture(scope="module")
def media_root(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("media-root")
    (root.parent / "secret.png").write_bytes((demo_dir / "media" / "relic.png").read_bytes())
    shutil.copy(demo_dir / "media" / "relic.png", root / "relic.png")
    return root


@pytest.fixture(scope="module")
def server(demo_cache_dir, demo_dir, media_root, tmp_path_factory):
    args = ["--demo", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--dtype", "float32"]
    args += ["--device", "cpu", "--allowed-local-media-path", str(media_root)]
    args += ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "3"]
    args += ["--adapter-root", str(tmp_path_factory.mktemp("adapter-root"))]
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield handle.url


@pytest.fixture(scope="module")
def image_url(demo_dir):
    return data_url((demo_dir / "media" / "relic.png").read_bytes(), "image/png")


@pytest.fixture(scope="module")
def bodies(image_url):
    return neighbour_bodies(image_url, NEIGHBOUR_TOKENS)


@pytest.fixture(scope="module")
def quiet(server, bodies):
    """The neighbours' outputs and a fresh request's time with no offender about."""
    return run_neighbours(server, bodies)


@pytest.fixture
def watch(server, bodies, quiet):
    baseline, quiet_s = quiet
    return Watch(server, bodies, baseline, quiet_s)


def chat(url: str, content, model: str = "relic", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4} | extra
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


# --- chat templates ------------------------------------------------------------------------------


def test_a_request_cannot_replace_or_steer_the_chat_template(server, watch):
    forged = "{% for m in messages %}SYSTEM OVERRIDE {{ m.content }}{% endfor %}"
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    huge = "{{ 'ab ' * 3000000 }}"
    with watch as w:
        results = w.attack(
            lambda: chat(server, "x", chat_template_kwargs={"chat_template": forged}),
            lambda: chat(server, "x", chat_template_kwargs={"chat_template": slow}),
            lambda: chat(server, "x", chat_template_kwargs={"chat_template": huge}),
            lambda: chat(server, "x", chat_template=forged),
            lambda: chat(server, "x", chat_template_kwargs={"tokenize": True}),
            lambda: chat(server, "x", chat_template_kwargs={"add_generation_prompt": False}),
            lambda: chat(server, "x", chat_template_kwargs=["enable_thinking"]),
        )
        for r in results[:3]:
            assert assert_error(r, 400, "chat_template", within=5)["param"] == "chat_template_kwargs"
        assert assert_error(results[3], 400, "own chat template", within=5)["param"] == "chat_template"
        assert_error(results[4], 400, "tokenize", within=5)
        assert_error(results[5], 400, "add_generation_prompt", within=5)
        assert_error(results[6], 400, within=5)
    # template variables still reach the template
    assert chat(server, "x", chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_text_beside_an_image_is_bounded_before_tokenising(server, watch, image_url):
    image = {"type": "image_url", "image_url": {"url": image_url}}
    text = "relic " * 1_300_000  # 7.8 MB, far more than 512 tokens can hold
    with watch as w:
        (r,) = w.attack(lambda: chat(server, [image, {"type": "text", "text": text}]))
        assert_error(r, 400, "characters, more than fit", within=3)
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_logit_bias_ids_outside_the_vocabulary_are_refused(server, watch):
    with watch as w:
        r1, r2, r3 = w.attack(
            lambda: chat(server, "x", logit_bias={"999999999": 5}),
            lambda: chat(server, "x", logit_bias={"-1": 5}),
            lambda: chat(server, "x", logit_bias={"nine": 5}),
        )
        assert_error(r1, 400, "logit_bias", within=5)
        assert_error(r2, 400, "logit_bias", within=5)
        assert_error(r3, 400, "logit_bias", within=5)
    assert chat(server, "x", logit_bias={"5": 2}).status_code == 200


def test_bad_words_are_bounded_and_tokenised_off_the_event_loop(server, watch):
    """128 bad words of 60 000 characters (7.7 MB, under the body limit) would be ~15M token ids to
    check and copy per choice: refused at once, naming the field, while /health keeps being answered.
    The longest allowed list (128 words of 512 characters) is tokenised on the text pool and served."""
    words = [f"w{i}" + " inscription" * 5000 for i in range(128)]
    with watch as w:
        (r,) = w.attack(lambda: chat(server, "x", bad_words=words))
        assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["param"].startswith("bad_words") and "512" in r.json()["error"]["message"]
    longest = [f"w{i}" + " inscription" * 42 for i in range(128)]
    assert all(len(word) <= 512 for word in longest)
    assert chat(server, "x", bad_words=longest).status_code == 200


# --- media -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host():
    with HostileServer() as server:
        yield server


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_media_hosts_that_never_answer_or_trickle_starve_no_one(server, watch, host):
    """8 images on a host that accepts and never answers, and hosts that trickle headers or body:
    each request fails at the one fetch deadline (3 s: connect, headers and body together)."""
    silent = [image_part(host.url("/silent")) for _ in range(8)]
    with watch as w:
        r_silent, r_headers, r_body = w.attack(
            lambda: chat(server, [*silent, {"type": "text", "text": "What is it?"}]),
            lambda: chat(server, [image_part(host.url("/trickle-headers")), {"type": "text", "text": "x"}]),
            lambda: chat(server, [image_part(host.url("/trickle-body")), {"type": "text", "text": "x"}]),
            settle_s=1.0,
        )
        for r in (r_silent, r_headers, r_body):
            assert_error(r, 400, "timed out", within=6)


def test_compressed_and_decoding_bombs_are_refused_cheaply(server, watch, host):
    with watch as w:
        gzip2, bomb, gif, ico, br = w.attack(
            lambda: chat(server, [image_part(host.url("/gzip-gzip")), {"type": "text", "text": "x"}]),
            lambda: chat(server, [image_part(host.url("/gzip-bomb")), {"type": "text", "text": "x"}]),
            lambda: chat(server, [video_part(data_url(hostile_gif(8000, 8000, 500), "image/gif"))]),
            lambda: chat(server, [image_part(data_url(ico_wrapping(png_header_bomb(12000)), "image/x-icon"))]),
            lambda: chat(server, [image_part(host.url("/br")), {"type": "text", "text": "x"}]),
        )
        assert_error(gzip2, 400, "gzip", within=5)
        assert_error(bomb, 400, within=5)
        assert_error(gif, 400, within=5)
        assert_error(ico, 400, within=5)
        assert_error(br, 400, "br", within=5)


def test_file_urls_are_no_existence_oracle(server, watch, media_root):
    outside = (media_root.parent / "secret.png").as_uri()
    missing = (media_root / "missing.png").as_uri()
    with watch as w:
        r_outside, r_missing, r_nul, r_redirect = w.attack(
            lambda: chat(server, [image_part(outside)]),
            lambda: chat(server, [image_part(missing)]),
            lambda: chat(server, [image_part("file://" + str(media_root) + "/relic.png%00.txt")]),
            lambda: chat(server, [image_part("http://127.0.0.1:1/a\u0000b")]),
        )
    a, b = assert_error(r_outside, 400, within=5), assert_error(r_missing, 400, within=5)
    outside_path, missing_path = str(media_root.parent / "secret.png"), str(media_root / "missing.png")
    # the same answer whether the file exists outside the root or is missing inside it
    assert a["message"].replace(outside_path, "P") == b["message"].replace(missing_path, "P")
    assert str(media_root) not in a["message"]  # the root is never shown (only the path the client sent)
    assert_error(r_nul, 400, "NUL", within=5)
    assert_error(r_redirect, 400, within=5)


def test_malformed_redirects_are_client_errors(server, watch, host):
    with watch as w:
        results = w.attack(
            lambda: chat(server, [image_part(host.url("/bad-redirect"))]),
            lambda: chat(server, [image_part(host.url("/no-location"))]),
            lambda: chat(server, [image_part(host.url("/loop"))]),
        )
        for r in results:
            assert_error(r, 400, within=5)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# --- structured outputs ----------------------------------------------------------------------------


def ref_chain(depth: int) -> dict:
    """A JSON schema whose $defs chain $refs `depth` deep (~100 KB at a few thousand)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_grammars_that_would_crash_or_freeze_the_compiler_fail_alone(server, watch):
    lark_chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
    gbnf_chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(3000)) + 'r3000 ::= "x"\n'
    nested = "[" * 950 + "]" * 950
    with watch as w:
        results = w.attack(
            lambda: chat(server, "x", response_format={"type": "json_schema", "json_schema": {
                "name": "deep", "schema": ref_chain(3000)}}),
            lambda: chat(server, "x", guided_grammar=lark_chain),
            lambda: chat(server, "x", guided_grammar=gbnf_chain),
            lambda: chat(server, "x", guided_grammar="\n" * 40_000 + 'start: "a"'),
            lambda: chat(server, "x", guided_json=nested),
            lambda: chat(server, "x", guided_json={"$ref": "#"}),
            lambda: chat(server, "x", guided_regex="(a{1000}){1000}"),
            lambda: chat(server, "x", guided_choice=[f"c{i}" for i in range(4096)]),
        )  # fmt: skip
        for r in results[:3] + results[4:]:
            assert_error(r, 400, within=10)
        assert results[3].status_code in (200, 400), results[3].text  # linear time either way
    # the server still compiles and serves grammars
    ok = chat(server, "x", guided_regex="(yes|no)", max_tokens=4)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_malformed_parts_arguments_and_media_options_are_client_errors(server, watch, image_url):
    """Found by fuzzing: each of these was a 500 (or, the last, killed the grammar worker)."""
    image = {"type": "image_url", "image_url": {"url": image_url}}
    deep = "[" * 5000 + "]" * 5000
    history = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]  # fmt: skip
    with watch as w:
        results = w.attack(
            lambda: chat(server, [{"type": ["image_url"], "image_url": {"url": image_url}}]),
            lambda: chat(server, [{"type": {"t": 1}, "text": "x"}]),
            lambda: httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
                "model": "relic", "messages": history, "max_tokens": 4}),
            lambda: chat(server, [image, {"type": "text", "text": "x"}], media_io_kwargs={"video": {"bogus": 1}}),
            lambda: chat(server, [image, {"type": "text", "text": "x"}], media_io_kwargs={"image": {"mode": "CMYK"}}),
            lambda: chat(server, "x", guided_json='{"enum": ["\\ud800"]}'),
        )  # fmt: skip
    assert_error(results[0], 400, "not supported")
    assert_error(results[1], 400, "not supported")
    assert_error(results[2], 400, "nested too deeply")
    assert_error(results[3], 400, "media_io_kwargs", "bogus")
    assert_error(results[4], 400, "media_io_kwargs", "mode")
    assert_error(results[5], 400, "invalid Unicode")
    ok = chat(server, "x", guided_regex="(yes|no)", max_tokens=4)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")


# --- large bodies, large responses, disconnects ------------------------------------------------------


def post_raw(url: str, raw: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=120)


def health_during_twice(url: str, fn: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """fn()'s response and the slowest /health answer while it ran; where that passed 1 s, the same
    again, and the better of the two. A body validated on the event loop stalls /health every time
    (2-5 s); a busy test machine delayed one answer once (1.1 s in one CI run, ~0.1 s otherwise)."""
    r, slowest = slowest_health_during(url, fn)
    if slowest >= 1.0:
        r, again = slowest_health_during(url, fn)
        slowest = min(slowest, again)
    return r, slowest


def test_huge_lists_are_refused_early_and_no_body_stalls_the_event_loop(server):
    """Bodies under the 8 MB limit that hold 520 000 messages, or millions of token ids, content parts
    or logit_bias entries, took seconds to validate on the event loop (/health waited 2-5 s). They are
    refused at once, naming the limit; bodies within the limits are validated off the event loop."""

    def body(fields: str) -> str:
        return '{"model":"relic","max_tokens":4,' + fields + "}"

    hi = '"messages":[{"role":"user","content":"hi"}]'
    ids = ",".join(["0"] * 2_700_000)
    offenders = {
        "messages": body('"messages":[' + ",".join(['{"role":"user"}'] * 520_000) + "]"),
        "stop_token_ids": body(hi + ',"stop_token_ids":[' + ids + "]"),
        "allowed_token_ids": body(hi + ',"allowed_token_ids":[' + ids + "]"),
        "logit_bias": body(hi + ',"logit_bias":{' + ",".join(f'"{i}":0' for i in range(700_000)) + "}"),
        "messages.0.content": body('"messages":[{"role":"user","content":[' + ",".join(["{}"] * 2_700_000) + "]}]"),
        "tools": body(hi + ',"tools":[' + ",".join(["{}"] * 2_000_000) + "]"),
        "tokens": '{"tokens":[' + ids + "]}",
    }
    for param, raw in offenders.items():
        assert len(raw) < 8 << 20
        path = "/detokenize" if param == "tokens" else "/v1/chat/completions"
        r, slowest = health_during_twice(server, lambda raw=raw, path=path: post_raw(server, raw, path))
        assert assert_error(r, 400, "at most")["param"] == param
        assert slowest < 1.0, f"/health took {slowest:.2f} s during the {param} body, twice"
    # within every bound, yet seconds to validate (2.5M tool calls): validated on a worker thread
    calls = '{"role":"assistant","content":"x","tool_calls":[' + ",".join(["{}"] * 250) + "]}"
    heavy = body('"messages":[' + ",".join([calls] * 10_000) + "]")
    r, slowest = health_during_twice(server, lambda: post_raw(server, heavy))
    assert_error(r, 400, "characters, more than fit")
    assert slowest < 1.0, f"/health took {slowest:.2f} s during the tool calls body, twice"
    many = [{"role": "user", "content": "x"}] * 20
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": many, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_huge_prompt_logprobs_response_is_built_off_the_event_loop(server):
    """64 prompts of 500 tokens with prompt_logprobs 20: a 46 MB response whose building (a decode per
    token shown) and serialising held the event loop for seconds."""
    prompts = [[(7 * i + j) % 600 + 1 for j in range(500)] for i in range(64)]
    body = {"model": "relic", "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
    r, slowest = slowest_health_during(server, lambda: httpx.post(f"{server}/v1/completions", json=body, timeout=300))
    assert r.status_code == 200, r.text[:500]
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the response was built"
    choices = r.json()["choices"]
    assert len(choices) == 64
    for choice, prompt in zip(choices, prompts, strict=True):
        logprobs = choice["prompt_logprobs"]
        assert len(logprobs) == 500 and logprobs[0] is None
        for token, entry in zip(prompt[1:], logprobs[1:], strict=True):
            assert str(token) in entry and len(entry) >= 20
            assert all(isinstance(v["decoded_token"], str) for v in entry.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_a_request_of_many_choices_stops_them(server, stream):
    """64 prompts × n 16: 1024 choices, submitted together (one by one, each waited for an engine step,
    and a client that gave up meanwhile had the rest submitted and run anyway: 30 s of work for
    nobody). A client that leaves, before the response (no stream) or after its first events, stops
    every choice: waiting, running and their KV pages."""
    body = {"model": "tomb", "prompt": [[i + 1] for i in range(64)], "n": 16, "max_tokens": 400,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = r.iter_lines()
            first = [next(events) for _ in range(20)]  # the stream has started, then the client hangs up
        assert any(line.startswith("data: ") for line in first)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, timeout=2)
    left = time.monotonic()
    gauges = ("hylora_waiting_requests", "hylora_running_requests", "hylora_kv_pages_used")
    while any(metric(server, g) for g in gauges) and time.monotonic() - left < 10:
        time.sleep(0.2)
    assert not any(metric(server, g) for g in gauges), {g: metric(server, g) for g in gauges}
