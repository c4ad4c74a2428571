"""Images and videos through the HTTP server: the same greedy tokens and prompt logprobs as the
offline engine; mixed text / image / video / adapter requests in one batch each equal their run
alone; a video sent to a second adapter is decoded and encoded once (media and encoder caches);
every bad media input is a 4xx with a message and the next request is unchanged."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import pytest
from PIL import Image

from hylora.demo import DEMO_ADAPTERS
from hylora.engine import LLM, SamplingParams
from tests.media_helpers import decode_all, garbage, video_bytes
from tests.server_helpers import metric, running_server

MAX_MODEL_LEN = 256


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(demo_dir):
    return {
        "video": data_url((demo_dir / "media" / "excavation.mp4").read_bytes(), "video/mp4"),
        "image": data_url((demo_dir / "media" / "relic.png").read_bytes(), "image/png"),
        "image_file": (demo_dir / "media" / "relic.png").as_uri(),
    }


@pytest.fixture(scope="module")
def server(demo_cache_dir, demo_dir, tmp_path_factory):
    args = ["--demo", "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--device", "cpu"]
    args += ["--allowed-local-media-path", str(demo_dir / "media"), "--limit-mm-per-prompt", '{"image": 2, "video": 1}']
    args += ["--max-video-frames", "16"]
    # frame lists through the worker processes (the default from 4 cores), against the offline engine's threads
    args += ["--media-frame-processes", "2"]
    # common vLLM launch options that change nothing here: accepted (transformers' fast processor; every frame loaded)
    args += ["--mm-processor-kwargs", '{"use_fast": true}', "--media-io-kwargs", '{"video": {"num_frames": -1}}']
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield handle.url


@pytest.fixture(scope="module")
def offline(demo_dir):
    lora = {n: demo_dir / "adapters" / n for n in DEMO_ADAPTERS}
    return LLM(demo_dir, lora_modules=lora, max_model_len=MAX_MODEL_LEN, device="cpu", dtype="float32")


def messages(*parts: tuple[str, str], text: str = "What does it show?") -> list[dict]:
    content = [{"type": kind, kind: {"url": url}} for kind, url in parts]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def ask(url: str, model: str | None, msgs: list[dict], **extra) -> httpx.Response:
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0} | extra | ({"model": model} if model else {})
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def offline_chat(offline, msgs, adapter, demo_dir, mm_processor_kwargs=None, **params):
    params = dict(max_tokens=10, temperature=0) | params
    return offline.chat(msgs, SamplingParams(**params), adapter, demo_dir / "media", mm_processor_kwargs)


def test_video_and_image_equal_offline_engine_with_prompt_logprobs(server, offline, media, demo_dir):
    cases = [
        ("relic", messages(("video_url", media["video"]))),
        ("tomb", messages(("image_url", media["image_file"]))),
        (None, messages(("image_url", media["image"]), ("video_url", media["video"]))),
    ]
    for model, msgs in cases:
        expected = offline_chat(offline, msgs, model, demo_dir, prompt_logprobs=1)
        r = ask(server, model, msgs, prompt_logprobs=1)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == expected.text
        assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)  # visual tokens counted
        got = body["prompt_logprobs"]
        assert got[0] is None and len(got) == len(expected.prompt_logprobs)
        for entry, want, tid in zip(got[1:], expected.prompt_logprobs[1:], expected.prompt_token_ids[1:], strict=True):
            assert entry[str(tid)]["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        stream = []
        with httpx.stream(
            "POST",
            f"{server}/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 10, "temperature": 0, "stream": True}
            | ({"model": model} if model else {}),
            timeout=120,
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    stream += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        assert "".join(stream) == expected.text


def test_mixed_batch_of_text_image_video_and_adapters_each_equal_alone(server, offline, media, demo_dir):
    cases = [
        (adapter, msgs)
        for adapter in ("relic", "mural", None)
        for msgs in (
            messages(("video_url", media["video"])),
            messages(("image_url", media["image"])),
            [{"role": "user", "content": "Describe the tomb."}],
        )
    ]
    expected = [offline_chat(offline, msgs, adapter, demo_dir).text for adapter, msgs in cases]
    results: dict[int, str] = {}

    def run(i, adapter, msgs):
        results[i] = ask(server, adapter, msgs).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=run, args=(i, *case)) for i, case in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(cases))] == expected


def test_the_same_video_for_another_adapter_is_decoded_and_encoded_once(server, offline, media, demo_dir):
    video = data_url(video_bytes(12, 96, 64, fps=4), "video/mp4")
    msgs = messages(("video_url", video))

    def counters() -> tuple[float, ...]:
        names = ("hylora_encoder_cache_hits", "hylora_media_cache_hits", "hylora_media_cache_misses")
        vllm = metric(server, "vllm:mm_cache_hits_total", 'model_name="hylora-demo"')  # vLLM's name for the same
        return (*(metric(server, name) for name in names), vllm)

    before = counters()
    first = ask(server, "relic", msgs).json()["choices"][0]["message"]["content"]
    after_first = counters()
    second = ask(server, "tomb", msgs).json()["choices"][0]["message"]["content"]
    after_second = counters()
    assert [a - b for a, b in zip(after_first, before, strict=True)] == [0, 0, 1, 0]  # a new video: decoded, encoded
    # the second adapter's request: preprocessed rows from the media cache, 3 temporal patches from the encoder cache
    assert [a - b for a, b in zip(after_second, after_first, strict=True)] == [3, 1, 0, 1]
    assert first == offline_chat(offline, msgs, "relic", demo_dir).text
    assert second == offline_chat(offline, msgs, "tomb", demo_dir).text
    r = ask(server, "mural", msgs, mm_processor_kwargs={"fps": 4})  # other preprocessing: decoded again
    assert r.status_code == 200, r.text
    assert counters()[2] - after_second[2] == 1


def test_a_video_sent_as_its_frames_equals_the_offline_engine(server, offline, demo_dir):
    """vLLM's data:video/jpeg;base64,<frame>,<frame>,... (frames sampled by the client), fps from
    media_io_kwargs as vLLM reads it; the server decodes the frames in its frame processes, the offline engine
    on threads."""
    frames, _ = decode_all(video_bytes(6, 96, 64, fps=4))
    jpegs = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG")
        jpegs.append(base64.b64encode(buf.getvalue()).decode())
    msgs = messages(("video_url", "data:video/jpeg;base64," + ",".join(jpegs)))
    r = ask(server, "tomb", msgs, media_io_kwargs={"video": {"fps": 4}})
    assert r.status_code == 200, r.text
    expected = offline_chat(offline, msgs, "tomb", demo_dir, mm_processor_kwargs={"fps": 4})
    assert r.json()["choices"][0]["message"]["content"] == expected.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    two_sizes = messages(
        ("video_url", "data:video/jpeg;base64," + jpegs[0] + "," + base64.b64encode(_png(32, 32)).decode())
    )
    bad = ask(server, "tomb", two_sizes)
    assert bad.status_code == 400 and "send the frames of a video at one size" in bad.json()["error"]["message"]


_CALL = {"id": "c0", "type": "function", "function": {"name": "look", "arguments": "{}"}}


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_media_get_4xx_and_the_next_request_is_unchanged(server, media, demo_dir, tmp_path):
    probe = messages(("image_url", media["image"]))
    expected = ask(server, "relic", probe).json()["choices"][0]["message"]["content"]
    video = video_bytes(14, 64, 96, fps=4)
    outside = tmp_path / "outside.png"
    outside.write_bytes(_png(64, 64))
    image_parts = [{"type": "image_url", "image_url": {"url": media["image"]}}]
    cases = [
        (messages(("video_url", data_url(video[: len(video) // 2], "video/mp4"))), "video"),  # truncated
        (messages(("video_url", data_url(garbage(), "video/mp4"))), "could not open video"),  # unknown container
        (messages(("image_url", data_url(garbage(), "image/png"))), "image"),  # corrupt image
        (messages(("image_url", "data:image/png;base64,not base64 !!")), "not valid base64"),
        (messages(("image_url", "data:image/png,plain")), "data URL must look like"),
        (messages(("image_url", data_url(_png(4000, 16), "image/png"))), "aspect ratio"),
        (messages(("image_url", outside.as_uri())), "no readable file"),  # as for a missing one
        (messages(("image_url", "http://example.com/x.png")), "not allowed on this server"),
        (messages(("image_url", "ftp://x/y.png")), "unsupported media URL scheme"),
        (messages(*[("image_url", media["image"])] * 3), "allows 2 per prompt"),
        (messages(("video_url", media["video"]), ("video_url", media["video"])), "allows 1 per prompt"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "not supported"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "expected"),
        ([{"role": "user", "content": [*image_parts, {"type": "text", "text": None}]}], "needs a string 'text'"),
        (  # Qwen's template renders a tool result's content as text only
            [
                {"role": "user", "content": "Look."},
                {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "c0", "content": image_parts},
            ],
            "images and videos in tool messages: put them in a user message",
        ),
    ]
    for msgs, needle in cases:
        r = ask(server, "relic", msgs)
        assert r.status_code == 400, (needle, r.text)
        assert needle in r.json()["error"]["message"], (needle, r.json())
    too_many = ask(server, "relic", messages(("video_url", media["video"])), mm_processor_kwargs={"num_frames": 64})
    assert too_many.status_code == 400 and "num_frames must be in" in too_many.json()["error"]["message"]
    bad_key = ask(server, "relic", messages(("video_url", media["video"])), mm_processor_kwargs={"fpss": 2})
    assert bad_key.status_code == 400 and "unsupported mm_processor_kwargs" in bad_key.json()["error"]["message"]
    # 16 frames = 8 temporal patches x 12 tokens: with the reply it no longer fits 256 tokens
    long = ask(
        server, "relic", messages(("video_url", media["video"])), mm_processor_kwargs={"num_frames": 16}, max_tokens=200
    )
    assert long.status_code == 400 and "maximum context length" in long.json()["error"]["message"]
    webm = data_url(video_bytes(8, 64, 64, fps=4, fmt="webm", codec="libvpx"), "video/webm")
    assert ask(server, "relic", messages(("video_url", webm))).status_code == 200  # header says 0 frames: counted
    assert ask(server, "relic", probe).json()["choices"][0]["message"]["content"] == expected
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_media_prompts_honour_add_generation_prompt_and_continue_final_message(server, media):
    """The media render path takes the chat options the text path takes: without the generation
    prompt the prompt is shorter; an assistant prefill continues (its text is the prompt's end)."""
    probe = messages(("image_url", media["image"]))
    usage = {flag: ask(server, "relic", probe, max_tokens=1, add_generation_prompt=flag).json()["usage"]
             for flag in (True, False)}  # fmt: skip
    assert usage[False]["prompt_tokens"] < usage[True]["prompt_tokens"]
    prefill = [*probe, {"role": "assistant", "content": "It shows a"}]
    r = ask(server, "relic", prefill, max_tokens=1, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text
    closed = ask(server, "relic", prefill, max_tokens=1, add_generation_prompt=False)
    assert r.json()["usage"]["prompt_tokens"] < closed.json()["usage"]["prompt_tokens"]  # no end of turn after it
