"""The embedded demo: a small vision-language checkpoint of the real architecture plus three task
adapters and a few seconds of synthetic media.

Everything is generated here, deterministically, from a fixed seed and a built-in text: a
byte-level BPE tokenizer with the Qwen special tokens and a ChatML chat template that renders
image and video parts, random weights for an 8-layer hybrid decoder (3 GDN + 1 gated attention,
twice) and a 2-block vision tower, the image / video processor configs, PEFT-format LoRA adapters
`relic`, `tomb` and `mural` with different ranks and target modules, and `media/excavation.mp4`
(a 3 s clip) and `media/relic.png`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from hylora.env import cache_dir
from hylora.model.checkpoint_out import partial_sibling, remove_stale_partials

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen3.5 / Qwen3.6's added tokens for thinking and tool calls: not special (they stay in the text
# with skip_special_tokens), each one token, as in the released tokenizers
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen3.5 / Qwen3.6's chat template in short: tools in a system block with the qwen3_coder call
# format, assistant tool calls and tool results in the history, an assistant turn's reasoning
# (`reasoning_content`, or the text before `</think>` in its content) in a think block on the turns after
# the last user message (on every turn with preserve_thinking), dropped before it, and thinking on unless
# enable_thinking is false (the generation prompt then closes an empty think block).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}"
    "{{- (tool['function'] if tool['function'] is defined else tool) | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first and message['content'] is string -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{%- if message['role'] == 'assistant' and (message['content'] is string or message['content'] is not iterable"
    " or message['content'] is not defined) -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if message['reasoning_content'] is string -%}{%- set reasoning = message['reasoning_content'] -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n<function=' + fn['name'] + '>\\n' -}}"
    "{%- for key, value in (fn['arguments'] | default({}, true)).items() -%}"
    "{{- '<parameter=' + key + '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
CORPUS = """\
The relic is a bronze vessel with a round belly, three legs and two upright handles.
Its surface carries a green patina; the rim shows a band of cloud and thunder motifs.
Material: cast bronze. Shape: tripod cauldron. Period: late Western Zhou, about 800 BC.
A jade disc with a central hole, polished on both faces, pale green with brown veins.
The tomb has a sloping ramp passage that leads north into a vaulted antechamber.
Two side chambers open east and west; the coffin chamber lies at the far end.
The passages are lined with grey bricks laid in a herringbone pattern.
The mural on the east wall shows a procession of riders and musicians.
Pigments: red ochre, malachite green, azurite blue and carbon black on lime plaster.
An inscription in ink names the tomb owner and the year of burial.
The paint is flaking near the floor where moisture has risen through the wall.
The camera moves slowly along the corridor; dust hangs in the light of the lamps.
At second twelve a ceramic figure of a horse appears on a low platform.
Describe the object, its material and its condition in plain words.
What does the video show? Where is the entrance? How many chambers are there?
"""
DEMO_ADAPTERS = {
    # name: (rank, alpha, rsLoRA, target modules)
    "relic": (8, 16, False, ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj"]),
    "tomb": (16, 16, True, ["in_proj_qkv", "in_proj_b", "in_proj_a", "gate_proj", "up_proj", "down_proj"]),
    "mural": (
        4,
        8,
        False,
        [
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_b",
            "in_proj_a",
            "out_proj",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
}
SEED = 1234
DEMO_VERSION = "7"  # bump when the demo changes: an older demo in the cache is rewritten


@dataclass(frozen=True)
class DemoShape:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    tokenizer_vocab: int = 1024
    # vision tower
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_num_heads: int = 2
    vision_position_table: int = 8  # an 8 x 8 learned position table


def default_demo_dir() -> Path:
    return cache_dir() / "demo"


def ensure_demo(path: Path | None = None) -> Path:
    """Write the demo into `path` (default cache dir) unless it is already complete there."""
    path = Path(path) if path else default_demo_dir()
    if _complete(path):
        return path
    # written beside `path` and renamed in whole: two servers starting at once on a fresh machine each
    # write their own copy, the first rename wins, and no one loads a half-written demo
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    tmp = partial_sibling(path)
    try:
        write_demo(tmp)
        if path.exists() and not _complete(path):  # an older version, or a write killed before the marker
            stale = path.parent / f".{path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                path.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(path)
        except OSError:
            if not _complete(path):  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _complete(path: Path) -> bool:
    marker = path / "DEMO_COMPLETE"
    return marker.is_file() and marker.read_text().strip() == DEMO_VERSION


def write_demo(path: str | Path, shape: DemoShape = DemoShape(), media: bool = True) -> Path:
    """The demo model, its task adapters and (with `media`) its sample image and video: `media=False`
    for benchmarks on machines without PyAV (the H200 image has none)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path, shape.tokenizer_vocab)
    vocab = len(tokenizer.get_vocab())
    im_end = tokenizer.token_to_id("<|im_end|>")
    token_ids = {
        "image_token_id": tokenizer.token_to_id("<|image_pad|>"),
        "video_token_id": tokenizer.token_to_id("<|video_pad|>"),
        "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"),
        "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>"),
    }
    config = _model_config(shape, vocab_size=math.ceil(vocab / 64) * 64, eos=im_end, token_ids=token_ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}, indent=2))
    for name, processor in _processor_configs().items():
        (path / name).write_text(json.dumps(processor, indent=2))
    weights = _random_weights(config, torch.Generator().manual_seed(SEED))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    for i, (name, spec) in enumerate(DEMO_ADAPTERS.items()):
        _write_adapter(path / "adapters" / name, weights, *spec, generator=torch.Generator().manual_seed(SEED + i + 1))
    if media:
        write_demo_media(path / "media")
    (path / "DEMO_COMPLETE").write_text(DEMO_VERSION + "\n")
    return path


def write_demo_media(path: Path) -> None:
    """`excavation.mp4`: 3 s at 8 fps, 128x96, a lamp-lit corridor with a figure moving across;
    `relic.png`: 160x120, a bronze vessel on a plinth. Synthetic, deterministic."""
    import av
    import numpy as np
    from PIL import Image, ImageDraw

    path.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (160, 120), (62, 48, 36))
    draw = ImageDraw.Draw(img)
    draw.rectangle((40, 95, 120, 110), fill=(120, 110, 100))
    draw.ellipse((55, 40, 105, 95), fill=(70, 120, 90))
    draw.rectangle((60, 30, 100, 42), fill=(90, 140, 110))
    img.save(path / "relic.png")

    with av.open(str(path / "excavation.mp4"), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(24):
            frame = np.zeros((96, 128, 3), dtype=np.uint8)
            frame[:, :] = (40 + i, 32 + i // 2, 24)
            frame[20:80, 10 + 4 * i : 30 + 4 * i] = (200, 170, 90)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _processor_configs() -> dict[str, dict]:
    """Small pixel budgets: the demo image is 20 visual tokens, the demo video 3 x 12."""
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    return {
        "preprocessor_config.json": common
        | {"image_processor_type": "Qwen2VLImageProcessorFast", "size": {"shortest_edge": 4096, "longest_edge": 65536}},
        "video_preprocessor_config.json": common
        | {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 4096, "longest_edge": 262144},
            "fps": 2,
            "min_frames": 4,
            "max_frames": 32,
        },
    }


def _train_tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TEXT_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # appended after the BPE vocab, as in Qwen
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    return tok


def write_tokenizer(path: Path, vocab_size: int):
    """Train the byte-level BPE (at most `vocab_size` ids, specials included) and write
    tokenizer.json + tokenizer_config.json (with the chat template) into `path`."""
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return tokenizer


def _model_config(s: DemoShape, vocab_size: int, eos: int, token_ids: dict[str, int]) -> dict:
    """The VL wrapper's config.json: text_config, vision_config and the media token ids."""
    vision = {
        "model_type": "qwen3_5",
        "depth": s.vision_depth,
        "hidden_size": s.vision_hidden_size,
        "intermediate_size": s.vision_intermediate_size,
        "num_heads": s.vision_num_heads,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": s.hidden_size,
        "num_position_embeddings": s.vision_position_table**2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "text_config": _text_config(s, vocab_size, eos),
        "vision_config": vision,
        **token_ids,
    }


def _text_config(s: DemoShape, vocab_size: int, eos: int) -> dict:
    layers = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s.num_hidden_layers)]
    rotary_half = int(s.head_dim * 0.25) // 2
    return {
        "model_type": "qwen3_5_text",
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "layer_types": layers,
        "mtp_num_hidden_layers": 1,  # the draft layer of MTP speculative decoding (random, as the rest)
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "linear_num_key_heads": s.linear_num_key_heads,
        "linear_num_value_heads": s.linear_num_value_heads,
        "linear_key_head_dim": s.linear_key_head_dim,
        "linear_value_head_dim": s.linear_value_head_dim,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",  # as Qwen's releases: the GDN state's dtype (hylora's is always fp32)
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": eos,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3],
            "mrope_interleaved": True,
        },
    }


def _random_weights(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    from hylora.config import ModelConfig
    from hylora.model.decoder import HybridDecoder
    from hylora.model.loader import checkpoint_layout

    with torch.device("meta"):
        model = HybridDecoder(ModelConfig.from_hf(cfg), vision=True, mtp=True)
    params = dict(model.named_parameters())
    shapes = {name: (rows, *params[dest].shape[1:]) for name, (dest, _, rows) in checkpoint_layout(model).items()}
    out = {}
    # text weights first, then the tower, then the MTP layer: each the same draws as before the next existed
    for name, shape in sorted(
        shapes.items(), key=lambda item: (item[0].startswith("mtp."), item[0].startswith("visual."))
    ):
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(0.01, 8.0, generator=g).log()
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g) * 0.5
        elif name.endswith("linear_attn.norm.weight") or (
            name.startswith("visual.") and "norm" in name and "weight" in name
        ):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)  # plain-weight norms (GDN output, tower LayerNorms)
        elif "norm" in name or name.endswith("bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:  # fan-in scaled so activations stay O(1) through the stack
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            t = torch.randn(shape, generator=g) * (1.5 if "embed" in name else 1.0 / math.sqrt(fan_in))
        if name == "lm_head.weight" or name.startswith("mtp."):
            key = name
        elif name.startswith("visual."):
            key = "model." + name
        else:
            key = "model.language_model." + name
        out[key] = t.contiguous()
    return out


def _write_adapter(
    path: Path,
    base: dict[str, torch.Tensor],
    rank: int,
    alpha: int,
    rslora: bool,
    targets: list[str],
    generator: torch.Generator,
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, w in base.items():
        module = key.rsplit(".", 2)[-2]
        if not key.endswith(".weight") or module not in targets or ".visual." in key or key.startswith("mtp."):
            continue
        prefix = "base_model.model." + key[: -len(".weight")]
        out_f, in_f = w.shape
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=generator) / math.sqrt(in_f)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=generator) * 0.5 / math.sqrt(rank)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": "hylora-demo",
                "r": rank,
                "lora_alpha": alpha,
                "use_rslora": rslora,
                "target_modules": targets,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "rank_pattern": {},
                "alpha_pattern": {},
                "layers_to_transform": None,
                "use_dora": False,
                "init_lora_weights": True,
                "inference_mode": True,
            },
            indent=2,
        )
    )
