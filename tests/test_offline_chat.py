"""The offline API's batched chat (`LLM.chat` with a list of conversations): every conversation's
output equals its own run alone, in order; the media are prepared while the engine runs (one video for
several adapters is decoded once, in one call and the next); a conversation with a broken video or an
unknown adapter gets an error output and the others are unaffected; one conversation alone still raises."""

from __future__ import annotations

import base64

import pytest

from hylora.demo import DEMO_ADAPTERS
from hylora.engine import LLM, SamplingParams
from hylora.media import MediaError
from hylora.media import video as video_module
from tests.media_helpers import garbage, video_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def llm(demo_dir):
    lora = {n: demo_dir / "adapters" / n for n in DEMO_ADAPTERS}
    return LLM(demo_dir, lora_modules=lora, max_model_len=256, device="cpu", dtype="float32")


def ask(kind: str, url: str, text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [{"type": kind, kind: {"url": url}}, {"type": "text", "text": text}]}]


def video_url(seed: int) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video_bytes(8 + 2 * seed, 96, 64, fps=4)).decode()


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = video_module.read_video
    monkeypatch.setattr(video_module, "read_video", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_batch_equals_each_conversation_alone_and_decodes_a_shared_video_once(llm, demo_dir, decodes):
    shared = video_url(0)
    image = (demo_dir / "media" / "relic.png").as_uri()
    convs = [
        ask("video_url", shared),
        ask("video_url", shared, "Who is there?"),
        [{"role": "user", "content": "Where is the tomb?"}],
        ask("image_url", image),
        ask("video_url", shared),
    ]
    adapters = ["relic", "tomb", None, "mural", "mural"]
    outs = llm.chat(convs, GREEDY, adapters, media_root=demo_dir / "media")
    assert isinstance(outs, list) and len(outs) == len(convs)
    assert len(decodes) == 1  # three conversations, one video: decoded once
    for conv, adapter, out in zip(convs, adapters, outs, strict=True):
        assert out.error is None and out.finish_reason == "length"
        alone = llm.chat(conv, GREEDY, adapter, media_root=demo_dir / "media")
        assert out.token_ids == alone.token_ids and out.prompt_token_ids == alone.prompt_token_ids
    assert len(decodes) == 1  # and not again in later calls


def test_a_broken_video_or_unknown_adapter_fails_only_its_conversation(llm, demo_dir):
    good = ask("video_url", video_url(1))
    broken = ask("video_url", "data:video/mp4;base64," + base64.b64encode(garbage()).decode())
    convs = [good, broken, good, [{"role": "user", "content": "Hello"}]]
    adapters = ["relic", "relic", "no-such-adapter", "tomb"]
    outs = llm.chat(convs, GREEDY, adapters)
    assert outs[1].finish_reason == "error" and "video" in outs[1].error
    assert outs[2].finish_reason == "error" and "no-such-adapter" in outs[2].error
    assert outs[0].token_ids == llm.chat(good, GREEDY, "relic").token_ids
    assert outs[3].token_ids == llm.chat(convs[3], GREEDY, "tomb").token_ids
    assert not llm.engine.has_unfinished()
    with pytest.raises(MediaError, match="video"):
        llm.chat(broken, GREEDY, "relic")  # one conversation: the error is raised
