"""The embedded demo is a real checkpoint: transformers and PEFT load it, and it is reproducible."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from safetensors import safe_open

from hylora.demo import DEMO_ADAPTERS, SPECIAL_TOKENS, TEXT_TOKENS, write_demo
from hylora.model.loader import load_model
from hylora.tokenizer import chat_prompt, load_tokenizer
from tests.helpers import hf_logits, hylora_logits


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo(tmp_path_factory.mktemp("demo"))


def _digest(path):
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_demo_is_deterministic(demo_dir, tmp_path):
    assert _digest(write_demo(tmp_path)) == _digest(demo_dir)
    # without its media (GPU benchmarks on an image without PyAV): the same model and adapters, no media
    text_only = _digest(write_demo(tmp_path / "text", media=False))
    assert text_only == {k: v for k, v in _digest(demo_dir).items() if not k.startswith("media/")}


def test_tokenizer_has_qwen_special_tokens_and_chat_template(demo_dir):
    tok = load_tokenizer(demo_dir)
    for special in SPECIAL_TOKENS:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, special
    for text in TEXT_TOKENS:  # one token each, and kept in the text by skip_special_tokens (as Qwen's)
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == text, text
    ids = chat_prompt(tok, [{"role": "user", "content": "Describe the relic."}])
    prompt = "<|im_start|>user\nDescribe the relic.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == prompt + "<think>\n"  # thinking on by default, as Qwen3.5 / 3.6
    ids = chat_prompt(tok, [{"role": "user", "content": "Describe the relic."}], enable_thinking=False)
    assert tok.decode(ids) == prompt + "<think>\n\n</think>\n\n"
    text = "Pigments: red ochre, 孔雀石 — ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_transformers_loads_demo_with_same_logits(demo_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    ref = Qwen3_5ForConditionalGeneration.from_pretrained(demo_dir).eval()
    ids = load_tokenizer(demo_dir).encode("The tomb has a sloping ramp passage that leads north.")
    ours, theirs = hylora_logits(load_model(demo_dir, progress=False), ids), hf_logits(ref, ids)
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_peft_loads_each_demo_adapter_and_it_changes_the_output(demo_dir, name):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    base = Qwen3_5ForConditionalGeneration.from_pretrained(demo_dir).eval()
    ids = list(range(3, 40))
    before = hf_logits(base, ids)
    peft = PeftModel.from_pretrained(base, demo_dir / "adapters" / name).eval()
    rank, _, _, targets = DEMO_ADAPTERS[name]
    assert peft.peft_config["default"].r == rank
    lora_a = [n for n, _ in peft.named_parameters() if ".lora_A." in n]
    assert {n.split(".")[-4] for n in lora_a} == set(targets)  # [..., module, lora_A, default, weight]
    with safe_open(str(demo_dir / "adapters" / name / "adapter_model.safetensors"), "pt") as f:
        assert len(lora_a) == sum(k.endswith("lora_A.weight") for k in f.keys())  # noqa: SIM118  # nothing dropped
    after = hf_logits(peft, ids)
    assert (after - before).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_hylora_applies_demo_adapters_as_peft_does(demo_dir, name):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    from hylora.adapters.registry import AdapterRegistry
    from hylora.generate import CachedRunner

    peft = PeftModel.from_pretrained(
        Qwen3_5ForConditionalGeneration.from_pretrained(demo_dir), demo_dir / "adapters" / name
    )
    model = load_model(demo_dir, progress=False)
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=16)
    registry.load(name, demo_dir / "adapters" / name)
    runner = CachedRunner(model, num_slots=1, num_pages=16, adapters=registry)
    ids = load_tokenizer(demo_dir).encode("At second twelve a ceramic figure of a horse appears.")
    got = runner.step([(runner.add(name), ids)], all_logits=True)[0]
    assert (got - hf_logits(peft.eval(), ids)).abs().max().item() <= 1e-4


def test_cli_generate_on_demo(tmp_path):
    env = {"HYLORA_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hylora",
            "generate",
            "--demo",
            "--prompt",
            "Describe the relic.",
            "--max-tokens",
            "8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "demo" / "DEMO_COMPLETE").is_file()
    assert out.stdout.strip()


def test_cli_reports_bad_model_dir_without_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hylora", "generate", str(tmp_path), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "no config.json" in out.stderr and "Traceback" not in out.stderr


def test_demo_model_never_writes_over_a_directory_with_files(tmp_path):
    """`hylora demo-model DIR` refuses a directory that holds anything (someone's model), as merge does."""
    import subprocess
    import sys

    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    out = subprocess.run(
        [sys.executable, "-m", "hylora", "demo-model", str(mine)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "is not an empty directory" in out.stderr, out.stderr
    assert [p.name for p in mine.iterdir()] == ["config.json"] and "mine" in (mine / "config.json").read_text()


def test_an_interrupted_demo_write_leaves_nothing_and_the_next_start_completes_it(tmp_path, monkeypatch):
    """The demo appears whole or not at all: a write that dies midway (a kill, a full disk) leaves no
    half-written model at the path a second server would load, and an older or unfinished demo there is
    replaced by a complete one."""
    import hylora.demo as demo

    target = tmp_path / "cache" / "demo"

    def dies(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "write_demo_media", dies)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo(target)
    assert not target.exists() and list(target.parent.iterdir()) == []
    monkeypatch.undo()

    target.mkdir(parents=True)  # an older version's leftovers, no completion marker
    (target / "config.json").write_text("{")
    (target / "stale.bin").write_bytes(b"x")
    assert demo.ensure_demo(target) == target
    assert _digest(target) == _digest(write_demo(tmp_path / "fresh"))
    assert [p.name for p in target.parent.iterdir()] == ["demo"]
    before = (target / "DEMO_COMPLETE").stat().st_mtime_ns
    demo.ensure_demo(target)  # complete: left as it is
    assert (target / "DEMO_COMPLETE").stat().st_mtime_ns == before
