"""Images and videos through the engine: prompt logprobs and greedy tokens equal transformers (and
transformers + PEFT merged with a task adapter) whatever the chunking and encoder budget; media
requests, text requests and adapters mixed in one batch each equal their run alone; the encoder
cache encodes a video once for several adapters without changing any output."""

from __future__ import annotations

import pytest
import torch

from hylora.engine import EngineConfig, LLMEngine, SamplingParams
from hylora.engine.multimodal import build_multimodal_prompt
from hylora.media.processor import ProcessedMedia
from tests.engine_helpers import max_logprob_diff, run
from tests.lora_helpers import peft_adapter
from tests.vl_helpers import IMAGE, VIDEO, build_prompt, hf_vl_logits

ATOL = 1e-4
PROMPTS = {
    "image": [("text", 5), ("image", (1, 4, 6)), ("text", 7)],
    "video_odd_t": [("text", 3), ("video", (3, 4, 4)), ("text", 6)],
    "image_video_text": [("text", 4), ("image", (1, 6, 4)), ("text", 9), ("video", (2, 4, 6)), ("text", 5)],
}
LANGUAGE_TARGETS = ["in_proj_qkv", "out_proj", "q_proj", "v_proj", "gate_proj", "down_proj"]


def media_items(p, tag: str) -> list[ProcessedMedia]:
    """The prompt's media as the engine takes them (pixel rows, grids, a content key), in prompt order."""
    items, image_row, video_row = [], 0, 0
    runs = iter(p.image_grids), iter(p.video_grids)
    order = [tok for i, tok in enumerate(p.ids) if tok in (IMAGE, VIDEO) and p.ids[i - 1] not in (IMAGE, VIDEO)]
    seen_video_runs = 0
    for tok in order:
        if tok == IMAGE:
            grid = next(runs[0])
            n = grid[0] * grid[1] * grid[2]
            items.append(
                ProcessedMedia("image", p.pixel_values[image_row : image_row + n], grid, 2, f"{tag}-i{image_row}")
            )
            image_row += n
        else:
            if seen_video_runs == 0:
                grid = next(runs[1])
                n = grid[0] * grid[1] * grid[2]
                pixels = p.pixel_values_videos[video_row : video_row + n]
                items.append(ProcessedMedia("video", pixels, grid, 2, f"{tag}-v{video_row}", (0.0,) * grid[0]))
                video_row += n
                seen_video_runs = grid[0]
            seen_video_runs -= 1
    return items


@pytest.fixture(scope="module")
def prompts():
    return {name: build_prompt(parts, seed=10 + i) for i, (name, parts) in enumerate(PROMPTS.items())}


@pytest.fixture(scope="module")
def adapter_dir(vl_media_ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_adapter") / "survey"
    peft = peft_adapter(vl_media_ckpt[1], path, seed=7, r=8, lora_alpha=16, target_modules=LANGUAGE_TARGETS)
    merged = peft.merge_and_unload().eval()
    return path, merged


def engine(ckpt, adapter=None, **config) -> LLMEngine:
    config = dict(device="cpu", max_model_len=512, max_num_seqs=8) | config
    lora = {"survey": adapter} if adapter else None
    return LLMEngine(ckpt, EngineConfig(**config), lora_modules=lora, progress=False)


def request(e: LLMEngine, rid: str, p, tag: str, max_tokens: int = 6, adapter=None):
    mm = build_multimodal_prompt(p.ids, media_items(p, tag), e.model.config.vision)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    e.add_request(rid, p.ids, params, adapter, mm=mm)


def alone_per_adapter(ckpt, adapter_path, p, tag: str) -> dict:
    """The request for the base and for the adapter, each alone on a fresh engine with no encoder cache."""
    outs = {}
    for adapter in (None, "survey"):
        e = engine(ckpt, adapter_path, encoder_cache_gb=0)
        request(e, f"v-{adapter}", p, tag, adapter=adapter)
        outs.update(run(e, {}))
    return outs


def assert_matches(out, p, ref) -> None:
    """Prompt logprobs and the generated tokens' logprobs equal the reference model's, up to the first
    generated placeholder id (transformers would take it for more media)."""
    gen = out.token_ids
    cut = next((i for i, t in enumerate(gen) if t in (IMAGE, VIDEO)), len(gen))
    logprobs = torch.log_softmax(hf_vl_logits(ref, p, gen[:cut]), dim=-1)
    want_prompt = logprobs[torch.arange(len(p.ids) - 1), torch.tensor(p.ids[1:])]
    got_prompt = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    assert (got_prompt - want_prompt).abs().max().item() <= ATOL
    for i in range(cut):
        assert gen[i] == int(logprobs[len(p.ids) - 1 + i].argmax()), f"token {i}"
        assert abs(out.logprobs[i].logprob - float(logprobs[len(p.ids) - 1 + i, gen[i]])) <= ATOL


@pytest.mark.parametrize("name", PROMPTS)
@pytest.mark.parametrize("chunk, encoder", [(512, 16384), (13, 8), (7, 4)])
def test_media_requests_equal_transformers(vl_media_ckpt, prompts, name, chunk, encoder):
    """Whole prefill, and chunks of 13 / 7 tokens with an encoder budget of one temporal patch or less
    per step (chunks stop before what cannot be encoded and continue the next step)."""
    e = engine(vl_media_ckpt[0], max_num_batched_tokens=chunk, max_num_encoder_tokens=max(encoder, 6))
    request(e, "r", prompts[name], name)
    out = run(e, {})["r"]
    assert out.finish_reason == "length"
    assert_matches(out, prompts[name], vl_media_ckpt[1])


def test_prefill_stops_before_media_the_encoder_budget_cannot_pay_for(vl_media_ckpt, prompts):
    """Budget 4 encoder tokens per step and segments of 4: each step's chunk ends right before the
    next temporal patch, which is encoded in the step after."""
    e = engine(vl_media_ckpt[0], max_num_encoder_tokens=4)
    request(e, "r", prompts["video_odd_t"], "v")
    segments = e.requests["r"].mm.segments
    reached = []
    while e.requests.get("r") is not None and e.requests["r"].num_computed < len(prompts["video_odd_t"].ids):
        e.step()
        reached.append(e.requests["r"].num_computed)
    assert reached[:3] == [segments[1].start, segments[2].start, len(prompts["video_odd_t"].ids)]


@pytest.mark.parametrize("encoder_budget, ahead_calls", [(16384, [3]), (8, [2, 1])])
def test_a_video_reached_by_small_chunks_is_encoded_ahead_in_few_tower_calls(
    vl_media_ckpt, prompts, encoder_budget, ahead_calls
):
    """Chunks of 5 tokens over a video of three 4-token temporal patches: the chunk that reaches the
    video encodes its later patches too, as far as the encoder budget goes (two patches, then the
    third, with a budget of 8); without encode_media_ahead each chunk encodes the patch it reaches.
    Tokens and logprobs are the same either way."""
    p = prompts["video_odd_t"]
    outs, calls = {}, {}
    for ahead in (True, False):
        e = engine(
            vl_media_ckpt[0], max_num_batched_tokens=5, max_num_encoder_tokens=encoder_budget,
            encode_media_ahead=ahead,
        )  # fmt: skip
        calls[ahead] = []
        real = e.model.visual.forward
        e.model.visual.forward = lambda *a, _c=calls[ahead], _r=real, **k: _c.append(len(a[1])) or _r(*a, **k)
        request(e, "r", p, "ahead")
        outs[ahead] = run(e, {})["r"]
    assert calls[True] == ahead_calls
    assert calls[False] == [1, 1, 1]
    assert outs[True].token_ids == outs[False].token_ids
    assert max_logprob_diff(outs[True], outs[False]) < 1e-5


def test_task_adapter_with_media_equals_peft_merged(vl_media_ckpt, prompts, adapter_dir):
    path, merged = adapter_dir
    e = engine(vl_media_ckpt[0], path, max_num_batched_tokens=11)
    for name in PROMPTS:
        request(e, name, prompts[name], name, adapter="survey")
    outs = run(e, {})
    for name in PROMPTS:
        assert_matches(outs[name], prompts[name], merged)


def test_mixed_media_text_and_adapters_equal_each_alone(vl_media_ckpt, prompts, adapter_dir):
    path, _ = adapter_dir
    text = build_prompt([("text", 30)], seed=99)
    cases = [(name, prompts[name], name, adapter) for name in PROMPTS for adapter in (None, "survey")]
    cases.append(("text", text, "text", "survey"))
    alone = {}
    for rid, p, tag, adapter in cases:
        e = engine(vl_media_ckpt[0], path)
        request(e, f"{rid}-{adapter}", p, tag, adapter=adapter)
        alone.update(run(e, {}))
    e = engine(vl_media_ckpt[0], path, max_num_batched_tokens=40, max_num_encoder_tokens=12)
    for rid, p, tag, adapter in cases:
        request(e, f"{rid}-{adapter}", p, tag, adapter=adapter)
    together = run(e, {})
    for rid, out in alone.items():
        assert together[rid].token_ids == out.token_ids, rid
        diff = max(
            abs(a.logprob - b.logprob)
            for a, b in zip(together[rid].prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True)
        )
        assert diff <= 1e-5, rid


def test_encoder_cache_encodes_a_video_once_for_several_adapters(vl_media_ckpt, prompts, adapter_dir):
    path, _ = adapter_dir
    p = prompts["video_odd_t"]
    fresh = alone_per_adapter(vl_media_ckpt[0], path, p, "same-video")
    e = engine(vl_media_ckpt[0], path)
    calls = []
    real = e.model.visual.forward
    e.model.visual.forward = lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k)
    for adapter in (None, "survey"):
        request(e, f"v-{adapter}", p, "same-video", adapter=adapter)
        out = run(e, {})
        assert out[f"v-{adapter}"].token_ids == fresh[f"v-{adapter}"].token_ids
    assert sum(calls) == 3  # three temporal patches, encoded once
    assert e.encoder_cache.hits == 3 and len(e.encoder_cache) == 3


@pytest.mark.parametrize("encoder_cache_gb", [1.0, 0.0])
def test_a_video_sent_to_several_adapters_in_one_step_is_encoded_once(
    vl_media_ckpt, prompts, adapter_dir, encoder_cache_gb
):
    """The users' workload: one video to several adapters at once. Their chunks land in the same step,
    which encodes each temporal patch once for all of them (also with the encoder cache off), and an
    encoder budget of one video's tokens still lets both start in that step."""
    path, _ = adapter_dir
    p = prompts["video_odd_t"]
    fresh = alone_per_adapter(vl_media_ckpt[0], path, p, "one-video")
    e = engine(vl_media_ckpt[0], path)
    segments = build_multimodal_prompt(p.ids, media_items(p, "one-video"), e.model.config.vision).segments
    budget = sum(seg.num_tokens for seg in segments)
    e = engine(vl_media_ckpt[0], path, encoder_cache_gb=encoder_cache_gb, max_num_encoder_tokens=budget)
    calls = []
    real = e.model.visual.forward
    e.model.visual.forward = lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k)
    for adapter in (None, "survey"):
        request(e, f"v-{adapter}", p, "one-video", adapter=adapter)
    outs = {o.request_id: o for o in e.step() if o.finished}
    # the first step took both requests past the video (the budget pays for it once)
    assert all(r.num_computed >= segments[-1].end for r in e.requests.values())
    outs |= run(e, {})
    assert len(calls) == 1 and sum(calls) == 3  # one tower call: three temporal patches for both adapters
    for rid, out in fresh.items():
        assert outs[rid].token_ids == out.token_ids
        assert max_logprob_diff(outs[rid], out) < 1e-5  # batched with the other adapter vs alone


def test_media_refusals(vl_media_ckpt, causal_ckpt, prompts):
    from hylora.engine import RequestError

    p = prompts["image"]
    e = engine(vl_media_ckpt[0], max_num_encoder_tokens=5)  # the image is 6 tokens
    with pytest.raises(RequestError, match="more than the 5 the server encodes per step"):
        request(e, "big", p, "x")
    text_only = engine(causal_ckpt[0])
    with pytest.raises(RequestError, match="no vision tower"):
        text_only.add_request(
            "m", p.ids, SamplingParams(), mm=build_multimodal_prompt(p.ids, media_items(p, "x"), e.model.config.vision)
        )


def test_tower_lora_adapter_through_the_engine_equals_peft_merged_and_keys_the_cache(
    vl_media_ckpt, prompts, adapter_dir, tmp_path
):
    """An adapter with LoRA on the tower and merger: its video request equals PEFT merged, and its
    tower outputs are cached under the adapter (the base adapter's request encodes its own)."""
    from tests.lora_helpers import TOWER_ADAPTER_SPECS

    tower_dir = tmp_path / "tower"
    merged = peft_adapter(vl_media_ckpt[1], tower_dir, seed=11, **TOWER_ADAPTER_SPECS["explicit"])
    merged = merged.merge_and_unload().eval()
    lora = {"survey": adapter_dir[0], "tower": tower_dir}
    e = LLMEngine(
        vl_media_ckpt[0],
        EngineConfig(device="cpu", max_model_len=512, max_num_batched_tokens=9, fault_injection=True),
        lora,
        progress=False,
    )
    assert e.adapters.get("tower").has_tower_lora and not e.adapters.get("survey").has_tower_lora
    p = prompts["image_video_text"]
    request(e, "tower", p, "same", adapter="tower")
    out = run(e, {})["tower"]
    assert_matches(out, p, merged)
    misses = e.encoder_cache.misses
    request(e, "survey", p, "same", adapter="survey")  # no tower LoRA: the base tower's outputs, not the cached ones
    run(e, {})
    assert e.encoder_cache.misses - misses == 3  # image + 2 temporal patches encoded again, for the base tower


def test_media_requests_survive_preemption_and_a_faulting_neighbour(vl_media_ckpt, prompts):
    """A KV cache too small for all requests at once: media requests are preempted and recompute
    (their segments re-fetched from the encoder cache), and a NaN-poisoned media request fails alone;
    every other request equals its run alone."""
    alone = {}
    for name in PROMPTS:
        e = engine(vl_media_ckpt[0])
        request(e, name, prompts[name], name, max_tokens=12)
        alone.update(run(e, {}))
    e = engine(vl_media_ckpt[0], num_pages=9, page_size=16, max_num_batched_tokens=24, fault_injection=True)
    for name in PROMPTS:
        request(e, name, prompts[name], name, max_tokens=12)
    request(e, "poisoned", prompts["image"], "image", max_tokens=12)
    e.inject_fault("poisoned")
    out = run(e, {})
    assert out["poisoned"].finish_reason == "error" and "numerical fault" in out["poisoned"].error
    assert sum(o.num_preemptions for o in out.values()) > 0
    for name in PROMPTS:
        assert out[name].token_ids == alone[name].token_ids, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the memory plan is measured on a CUDA device")
def test_memory_plan_reserves_a_tower_call_at_the_whole_encoder_budget(vl_media_ckpt):
    """The KV cache is sized after a tower call at the step's encoder budget: a real call of that size,
    with frames of another shape, needs no more than the plan's profile of it."""
    from hylora.engine.memory import _profile_tower

    config = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_encoder_tokens=4096)
    e = engine(vl_media_ckpt[0], **config)
    profiled = _profile_tower(e.model, e.config)
    assert profiled > 0
    visual = e.model.visual
    frames = 4096 * visual.config.merge_unit // (16 * 24)  # frames of 16 x 24 patches
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        pixels = torch.randn(frames * 16 * 24, visual.config.patch_dim, device="cuda")
        out = visual(pixels, torch.tensor([(frames, 16, 24)]))
        assert torch.isfinite(out).all()
        used = torch.cuda.max_memory_allocated() - base
    assert used <= 1.05 * profiled, (used, profiled)
