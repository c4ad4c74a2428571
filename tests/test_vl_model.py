"""The whole VL model (tower + M-RoPE + decoder with visual embeddings) gives transformers' logits."""

from __future__ import annotations

import pytest
import torch

from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from hylora.model.mrope import MRopePositions, mrope_positions
from hylora.model.multimodal import PromptEmbeds, encode_media, placeholder_embeds
from tests.vl_helpers import IMAGE, VISION_START, Prompt, build_prompt, hf_vl_logits, token_types

ATOL = 1e-4
DECODE_STEPS = 16
PROMPTS = {
    "text_only": [("text", 40)],
    "image": [("text", 6), ("image", (1, 8, 12)), ("text", 10)],
    "video_even": [("text", 5), ("video", (2, 4, 6)), ("text", 8)],
    "video_odd": [("text", 5), ("video", (3, 6, 4)), ("text", 7)],
    "image_video_multiturn": [
        ("text", 4),
        ("image", (1, 16, 12)),
        ("text", 8),
        ("video", (3, 4, 8)),
        ("text", 6),  # the assistant's answer and the next user turn
        ("text", 12),
        ("image", (1, 4, 4)),
        ("text", 5),
    ],
    "two_videos": [("text", 3), ("video", (3, 8, 8)), ("text", 5), ("video", (2, 12, 8)), ("text", 4)],
}
MEDIA_PROMPTS = [name for name in PROMPTS if name != "text_only"]


@pytest.fixture(scope="module")
def pair(vl_media_ckpt):
    path, ref = vl_media_ckpt
    return load_model(path, progress=False, vision=True), ref


@pytest.fixture(scope="module")
def prompts() -> dict[str, Prompt]:
    return {name: build_prompt(parts, seed=i * 10) for i, (name, parts) in enumerate(PROMPTS.items())}


@pytest.fixture(scope="module")
def hf_prompt_logits(pair, prompts) -> dict[str, torch.Tensor]:
    return {name: hf_vl_logits(pair[1], p) for name, p in prompts.items() if name != "text_only"}


def prepare(model, p: Prompt) -> tuple[MRopePositions, PromptEmbeds]:
    vision = model.config.vision
    positions = mrope_positions(p.ids, vision, p.image_grids, p.video_grids)
    embeds = encode_media(
        model.visual, p.ids, p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw
    )
    return positions, embeds


def runner_for(model, *prompts: Prompt) -> CachedRunner:
    pages = sum(len(p.ids) + DECODE_STEPS for p in prompts) // 16 + 2 * len(prompts)
    return CachedRunner(model, num_slots=len(prompts) + 1, num_pages=pages, page_size=16)


@pytest.mark.parametrize("name", PROMPTS)
def test_positions_match_transformers(pair, prompts, name):
    model, ref = pair
    p = prompts[name]
    ours = mrope_positions(p.ids, model.config.vision, p.image_grids, p.video_grids)
    extended = p.ids + [5, 6, 7, 8, 9]  # prompt + generated text: positions continue at i + delta
    want, want_delta = ref.model.get_rope_index(
        torch.tensor([extended]), token_types(extended), p.image_grid_thw, p.video_grid_thw
    )
    _, prompt_delta = ref.model.get_rope_index(
        torch.tensor([p.ids]), token_types(p.ids), p.image_grid_thw, p.video_grid_thw
    )
    assert torch.equal(ours.prompt, want[:, 0, : len(p.ids)])
    assert ours.delta == int(prompt_delta)
    assert torch.equal(ours.window(0, len(extended)), want[:, 0])
    assert torch.equal(ours.window(len(p.ids) + 2, len(p.ids) + 3), want[:, 0, len(p.ids) + 2 :][:, :1])
    if name != "text_only":
        assert ours.delta < 0  # visual tokens share positions


@pytest.mark.parametrize("name", MEDIA_PROMPTS)
def test_prefill_then_greedy_decode(pair, prompts, hf_prompt_logits, name):
    model, ref = pair
    p = prompts[name]
    runner = runner_for(model, p)
    seq = runner.add(None, *prepare(model, p))
    prefill = runner.step([(seq, p.ids)], all_logits=True)[0]
    assert (prefill - hf_prompt_logits[name]).abs().max().item() <= ATOL

    steps, generated = [prefill[-1]], []
    for _ in range(DECODE_STEPS):
        # greedy over the text ids: a generated placeholder id would make transformers look for media
        generated.append(int(steps[-1][:VISION_START].argmax()))
        steps.append(runner.step([(seq, generated[-1:])])[0])
    want = hf_vl_logits(ref, p, generated)[len(p.ids) - 1 :]
    assert (torch.stack(steps) - want).abs().max().item() <= ATOL


def _cuts_inside_visual_runs(p: Prompt) -> list[int]:
    runs = p.visual_runs()
    (first, first_end), (last, last_end) = runs[0], runs[-1]
    cuts = {1, first + 1, (first + first_end) // 2, last, last_end - 1}
    return sorted(c for c in cuts if 0 < c < len(p.ids))


@pytest.mark.parametrize("name", MEDIA_PROMPTS)
def test_chunked_prefill_split_inside_visual_runs(pair, prompts, hf_prompt_logits, name):
    model, _ = pair
    p = prompts[name]
    runner = runner_for(model, p)
    seq = runner.add(None, *prepare(model, p))
    bounds = [0, *_cuts_inside_visual_runs(p), len(p.ids)]
    pieces = [runner.step([(seq, p.ids[a:b])], all_logits=True)[0] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert (torch.cat(pieces) - hf_prompt_logits[name]).abs().max().item() <= ATOL


def test_multimodal_and_text_sequences_in_one_step(pair, prompts, hf_prompt_logits):
    """Chunks of two media prompts (cut inside visual runs) and a text prompt share each varlen step."""
    model, ref = pair
    names = ["image_video_multiturn", "two_videos", "text_only"]
    runner = runner_for(model, *(prompts[n] for n in names))
    seqs = {n: runner.add(None, *prepare(model, prompts[n])) for n in names[:2]} | {"text_only": runner.add()}
    want = dict(hf_prompt_logits) | {"text_only": hf_vl_logits(ref, prompts["text_only"])}
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    done = dict.fromkeys(names, 0)
    sizes = [37, 23, 50]  # different chunk sizes so the cuts fall at different places in each prompt
    while any(done[n] < len(prompts[n].ids) for n in names):
        feeds = []
        for n, size in zip(names, sizes, strict=True):
            if done[n] < len(prompts[n].ids):
                feeds.append((n, prompts[n].ids[done[n] : done[n] + size]))
                done[n] += len(feeds[-1][1])
        out = runner.step([(seqs[n], toks) for n, toks in feeds], all_logits=True)
        for (n, _), logits in zip(feeds, out, strict=True):
            got[n].append(logits)
    for n in names:
        assert (torch.cat(got[n]) - want[n]).abs().max().item() <= ATOL, n


def test_visual_embeddings_change_the_logits(pair, prompts, hf_prompt_logits):
    """The media actually reach the decoder: without them the logits are far from transformers'."""
    model, _ = pair
    p = prompts["image"]
    runner = runner_for(model, p)
    positions, _ = prepare(model, p)
    plain = runner.step([(runner.add(None, positions), p.ids)], all_logits=True)[0]
    assert (plain - hf_prompt_logits["image"]).abs().max().item() > 100 * ATOL


def test_placeholder_mismatches_are_refused(pair, prompts):
    model, _ = pair
    vision = model.config.vision
    p = prompts["image_video_multiturn"]
    with pytest.raises(ValueError, match="more image placeholder runs than image grids"):
        mrope_positions(p.ids, vision, p.image_grids[:1], p.video_grids)
    with pytest.raises(ValueError, match="1 video frame grid"):
        mrope_positions(p.ids, vision, p.image_grids, [(4, *p.video_grids[0][1:])])
    with pytest.raises(ValueError, match="does not fit its grid"):
        mrope_positions(p.ids, vision, [(1, 4, 4), (1, 16, 12)], p.video_grids)
    one_less = p.ids[: p.ids.index(IMAGE)] + p.ids[p.ids.index(IMAGE) + 1 :]
    with pytest.raises(ValueError, match="image placeholder tokens but the images give"):
        placeholder_embeds(one_less, vision, torch.zeros(52, 64), None)
