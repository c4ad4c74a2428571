"""`hylora merge` and `hylora quantize` write OUT_DIR all or nothing and fail with one line: an OUT_DIR
that is a file or sits in a directory nobody can write to, a disk that fills midway, a truncated input
shard. A failed run leaves no OUT_DIR (or the empty one it was given) and no temporary directory."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import hylora.adapters.merge
import hylora.model.fp8
from hylora.adapters.merge import merge_adapter
from hylora.cli import main
from hylora.demo import write_demo
from hylora.model.fp8 import quantize_checkpoint
from hylora.model.loader import load_model

ENOSPC = OSError(28, "No space left on device")
# what safetensors itself raises when the disk is full
ENOSPC_SAFETENSORS = SafetensorError(
    'Error while serializing: I/O error: No space left on device (os error 28) at path "/out/.tmpX"'
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo checkpoint (one weights file) and the same weights in two shards with an index."""
    single = write_demo(tmp_path_factory.mktemp("demo") / "demo", media=False)
    sharded = tmp_path_factory.mktemp("sharded")
    for item in single.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (sharded / item.name).write_bytes(item.read_bytes())
    tensors = load_file(single / "model.safetensors")
    keys = sorted(tensors)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    for name, part in zip(names, halves, strict=True):
        save_file({k: tensors[k] for k in part}, sharded / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in zip(names, halves, strict=True) for k in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return single, sharded


def run(which: str, demo, model_dir, out_dir):
    if which == "merge":
        return merge_adapter(model_dir, demo[0] / "adapters" / "relic", out_dir, progress=False)
    return quantize_checkpoint(model_dir, out_dir, progress=False)


def cli(capsys, *argv) -> str:
    """`hylora ARGV` that must fail as a usage error: its error line (after any progress bar), no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and last.startswith("hylora: error: ") and "Traceback" not in err, err
    return last


def fail_on_second_save(monkeypatch, module, error: Exception) -> None:
    """The second weights file written raises `error` (the first is complete on disk)."""
    calls = []
    real = module.save_file

    def save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise error
        real(*args, **kwargs)

    monkeypatch.setattr(module, "save_file", save_file)


def test_success_leaves_only_out_dir(demo, tmp_path):
    single, sharded = demo
    out = tmp_path / "given"
    out.mkdir()  # an empty directory given is filled
    assert quantize_checkpoint(sharded, out, progress=False) == out
    assert merge_adapter(single, single / "adapters" / "tomb", tmp_path / "merged", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given", "merged"]
    assert "model-00002-of-00002.safetensors" in os.listdir(out) and (out / "tokenizer.json").is_file()
    load_model(out, progress=False)
    load_model(tmp_path / "merged", progress=False)


def test_a_run_killed_outright_leaves_a_sibling_the_next_run_removes(demo, tmp_path):
    """SIGKILL (or the OOM killer) gives a run no chance to remove its hidden sibling, a model's worth of
    disk; the next run for that OUT_DIR on this machine removes it. A running writer's and another
    machine's siblings are kept (a shared file system)."""
    import signal
    import socket
    import subprocess
    import sys

    single, _ = demo
    out = tmp_path / "fp8"
    code = ("import sys; from hylora.model.fp8 import quantize_checkpoint; import hylora.model.fp8 as m; "
            "real = m.save_file\n"
            "def stall(*a, **k):\n    real(*a, **k); print('written', flush=True); sys.stdin.read()\n"
            "m.save_file = stall; quantize_checkpoint(sys.argv[1], sys.argv[2], progress=False)")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code, str(single), str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout.readline().strip() == "written"  # the weights are in its sibling, not yet renamed
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".fp8.partial-")]
    assert len(left) == 1 and not out.exists() and any(left[0].iterdir())
    host = socket.gethostname()
    running = tmp_path / f".fp8.partial-{host}-{os.getpid()}-0123abcd"  # this process: a writer still running
    elsewhere = tmp_path / f".fp8.partial-{host}x-{child.pid}-0123abcd"  # another machine's
    running.mkdir(), elsewhere.mkdir()
    assert quantize_checkpoint(single, out, progress=False) == out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fp8", running.name, elsewhere.name])
    load_model(out, progress=False)


def test_out_dir_that_is_a_file_is_refused_untouched(demo, tmp_path, capsys):
    single, _ = demo
    out = tmp_path / "out"
    out.write_text("my notes")
    err = cli(capsys, "merge", single, single / "adapters" / "relic", out)
    assert f"{out} is not an empty directory" in err
    err = cli(capsys, "quantize", single, out)
    assert f"{out} is not an empty directory" in err
    assert out.read_text() == "my notes" and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("which", ["merge", "quantize"])
@pytest.mark.parametrize("error", [ENOSPC, ENOSPC_SAFETENSORS], ids=["oserror", "safetensors"])
def test_disk_full_midway_leaves_nothing(demo, tmp_path, monkeypatch, which, error):
    _, sharded = demo
    module = hylora.adapters.merge if which == "merge" else hylora.model.fp8
    given = tmp_path / "given"
    for out in (tmp_path / "out", given):  # a new OUT_DIR; an empty one given
        if out == given:
            given.mkdir()
        with monkeypatch.context() as patch:
            fail_on_second_save(patch, module, error)
            with pytest.raises(ValueError, match="No space left on device") as info:
                run(which, demo, sharded, out)
        assert f"writing {out} failed" in str(info.value) and "nothing was left behind" in str(info.value)
        # no OUT_DIR (or the empty one as it was), no temporary directory
        assert os.listdir(tmp_path) == ([] if out != given else ["given"]) and not any(given.glob("*"))


def test_disk_full_through_the_cli(demo, tmp_path, monkeypatch, capsys):
    _, sharded = demo
    fail_on_second_save(monkeypatch, hylora.model.fp8, ENOSPC)
    err = cli(capsys, "quantize", sharded, tmp_path / "out")
    assert "No space left on device" in err and "nothing was left behind" in err
    assert os.listdir(tmp_path) == []


def test_truncated_shard_is_named(demo, tmp_path, capsys):
    single, sharded = demo
    for src in (single, sharded):  # the weights file read up front; the second shard read midway
        broken = tmp_path / f"broken-{src.name}"
        broken.mkdir()
        shard = broken / sorted(src.glob("*.safetensors"))[-1].name
        for item in src.iterdir():
            if item.is_file():
                data = item.read_bytes()
                (broken / item.name).write_bytes(data[: len(data) // 2] if item.name == shard.name else data)
        err = cli(capsys, "quantize", broken, tmp_path / "out")
        assert f"{shard} could not be read as safetensors" in err
        with pytest.raises(ValueError, match=f"{shard} could not be read as safetensors"):
            merge_adapter(broken, single / "adapters" / "relic", tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(f"broken-{src.name}" for src in (single, sharded))


def test_parent_not_writable(demo, tmp_path, capsys):
    single, _ = demo
    (tmp_path / "a-file").write_text("")
    err = cli(capsys, "quantize", single, tmp_path / "a-file" / "out")
    assert f"cannot create {tmp_path / 'a-file' / 'out'}: [Errno 17] File exists: '{tmp_path / 'a-file'}'" in err
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        err = cli(capsys, "merge", single, single / "adapters" / "relic", locked / "out")
        assert f"{locked} is not writable" in err
    finally:
        locked.chmod(0o755)
    assert os.listdir(locked) == []
