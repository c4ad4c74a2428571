"""The merged-weights reference folds an adapter into the loaded weights in place: inside the block
the weights equal `hylora merge`'s checkpoint, afterwards every parameter holds its original bits
again — restored from a copy of the touched rows or re-read from the checkpoint."""

from __future__ import annotations

import pytest
import torch

from hylora.adapters.files import read_adapter
from hylora.adapters.merge import merge_adapter
from hylora.demo import DEMO_ADAPTERS
from hylora.doctor.merged import merged, touched_bytes, touched_rows
from hylora.model.loader import load_model


@pytest.fixture(scope="module")
def model(demo_dir):
    return load_model(demo_dir, progress=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: bits(p).clone() for name, p in model.named_parameters()}


def assert_bit_identical(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    changed = [name for name, p in model.named_parameters() if not torch.equal(bits(p), before[name])]
    assert not changed, f"not restored bit for bit: {changed[:5]}"


@pytest.mark.parametrize("restore", ["copy", "checkpoint"])
@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_fold_equals_hylora_merge_and_restores_every_bit(model, demo_dir, tmp_path, name, restore):
    adapter = read_adapter(demo_dir / "adapters" / name, model.config, name)
    on_disk = load_model(merge_adapter(demo_dir, demo_dir / "adapters" / name, tmp_path / "m", progress=False))
    merged_params = dict(on_disk.named_parameters())
    before = snapshot(model)
    with merged(model, adapter, restore, demo_dir) as strategy:
        assert strategy == restore
        differ = {n for n, p in model.named_parameters() if not torch.equal(bits(p), before[n])}
        assert differ == {rows.param for rows, _ in touched_rows(model, adapter)}  # nothing else was touched
        for n, p in model.named_parameters():
            assert torch.equal(bits(p), bits(merged_params[n])), n  # the weights `hylora merge` writes
    assert_bit_identical(model, before)


def test_restored_after_an_error_inside_the_block(model, demo_dir):
    adapter = read_adapter(demo_dir / "adapters" / "mural", model.config, "mural")
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), merged(model, adapter, "auto", demo_dir):
        raise RuntimeError("boom")
    assert_bit_identical(model, before)


def test_auto_restores_from_the_checkpoint_when_the_rows_do_not_fit(model, demo_dir, monkeypatch):
    adapter = read_adapter(demo_dir / "adapters" / "tomb", model.config, "tomb")
    assert touched_bytes(model, adapter) > 0
    monkeypatch.setattr("hylora.doctor.merged._available_host_bytes", lambda: 0)
    before = snapshot(model)
    with merged(model, adapter, "auto", demo_dir) as strategy:
        assert strategy == "checkpoint"
    assert_bit_identical(model, before)
