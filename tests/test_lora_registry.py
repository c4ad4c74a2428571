"""The adapter registry: runtime load / unload / reload, slot LRU, CPU cache, pinning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylora.adapters.files import AdapterError
from hylora.adapters.registry import AdapterRegistry, NoFreeLoRASlot, UnknownAdapter
from hylora.generate import CachedRunner
from hylora.model.layers import Linear
from hylora.model.loader import load_model
from tests.helpers import random_ids
from tests.lora_helpers import peft_adapter

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapter_dirs(causal_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("reg")
    targets = [["in_proj_qkv", "out_proj"], ["q_proj", "up_proj", "in_proj_z"], ["in_proj_b", "down_proj"]]
    for i, (name, t) in enumerate(zip("abc", targets, strict=True)):
        peft_adapter(causal_ckpt[1], root / name, seed=40 + i, r=4, lora_alpha=8, target_modules=t)
    return {name: root / name for name in "abc"}


@pytest.fixture()
def model(causal_ckpt):
    return load_model(causal_ckpt[0], progress=False)


def reference(model, adapter_dir, ids):
    """Logits of `ids` under a fresh registry holding only this adapter (or none)."""
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8)
    runner = CachedRunner(model, num_slots=1, num_pages=32, adapters=registry)
    name = registry.load("ref", adapter_dir).name if adapter_dir else None
    return runner.step([(runner.add(name), ids)], all_logits=True)[0]


def test_a_matrices_live_under_the_weight(model, adapter_dirs):
    """Linear.stack_lora_a: every LoRA-capable linear keeps [W; A of every slot] in one buffer, so
    one GEMM gives the base output and each slot's x·Aᵀ (decode's shrink). The weight keeps its
    values; an adapter loaded into a slot writes its A rows there; eviction zeroes them."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    registry = AdapterRegistry(model, max_loras=2, max_lora_rank=8)
    for name, m in linears.items():
        assert torch.equal(m.weight, before[name]) and m.weight.data_ptr() == m.stacked_weight.data_ptr()
        rows = m.stacked_weight[m.out_features :].view(len(m.slices), 2, 8, m.in_features)
        assert all(a.data_ptr() == rows[i].data_ptr() for i, a in enumerate(m.lora.a))
    registry.load("a", adapter_dirs["a"])  # targets in_proj_qkv (the GDN in_proj's first slice), out_proj
    lease = registry.acquire("a")
    in_proj = next(m for n, m in linears.items() if n.endswith("linear_attn.in_proj"))
    x = torch.randn(3, in_proj.in_features)
    full = F.linear(x, in_proj.stacked_weight)
    torch.testing.assert_close(full[:, : in_proj.out_features], F.linear(x, in_proj.weight), rtol=0, atol=0)
    h = full[:, in_proj.out_features :].view(3, len(in_proj.slices), 2, 8)
    a = in_proj.lora.a[0][lease.slot]  # [8, in]
    assert a.abs().sum() > 0
    torch.testing.assert_close(h[:, 0, lease.slot], x @ a.T, rtol=1e-5, atol=1e-5)
    registry.release(lease)
    registry.unload("a")
    assert not in_proj.stacked_weight[in_proj.out_features :].any()  # the slot was cleared


def test_reload_and_unload_during_requests_keep_running_outputs(model, adapter_dirs):
    prompt, more = random_ids(80, 320, seed=1), random_ids(40, 320, seed=2)
    expect_a = reference(model, adapter_dirs["a"], prompt + more)
    expect_b = reference(model, adapter_dirs["b"], prompt + more)

    registry = AdapterRegistry(model, max_loras=3, max_lora_rank=8)
    runner = CachedRunner(model, num_slots=4, num_pages=64, adapters=registry)
    registry.load("task", adapter_dirs["a"])
    registry.load("other", adapter_dirs["c"])
    running = runner.add("task")
    doomed = runner.add("other")
    first = runner.step([(running, prompt), (doomed, prompt)], all_logits=True)[0]

    registry.load("task", adapter_dirs["b"])  # reload: new requests get b, `running` stays on a
    registry.unload("other")  # hidden for new requests, `doomed` finishes on c
    with pytest.raises(UnknownAdapter, match="no adapter named 'other'.*loaded: task"):
        runner.add("other")
    newcomer = runner.add("task")
    second, _, new_logits = runner.step([(running, more), (doomed, more), (newcomer, prompt + more)], all_logits=True)

    assert (torch.cat([first, second]) - expect_a).abs().max().item() <= ATOL
    assert (new_logits - expect_b).abs().max().item() <= ATOL
    runner.release(doomed)
    runner.release(running)
    assert registry.stats()["slots_used"] == 1  # only the new version of 'task' remains on the device
    runner.release(newcomer)


def test_slots_are_reused_least_recently_used_first(model, adapter_dirs):
    ids = random_ids(30, 320, seed=3)
    registry = AdapterRegistry(model, max_loras=2, max_lora_rank=8)
    for name, path in adapter_dirs.items():
        registry.load(name, path)
    runner = CachedRunner(model, num_slots=4, num_pages=32, adapters=registry)
    a, b = runner.add("a"), runner.add("b")
    runner.release(a)
    c = runner.add("c")  # takes a's slot
    assert c.lora.slot == 0 and registry.slot_of("a") is None
    with pytest.raises(NoFreeLoRASlot, match="all 2 LoRA slots"):
        runner.add("a")  # b and c are both running
    out_b, out_c = runner.step([(b, ids), (c, ids)])
    runner.release(b)
    a = runner.add("a")  # back on the device, in b's old slot
    (out_a,) = runner.step([(a, ids)])
    for name, got in [("a", out_a), ("b", out_b), ("c", out_c)]:
        assert (got - reference(model, adapter_dirs[name], ids)[-1]).abs().max().item() <= ATOL, name


def test_pinned_adapter_keeps_its_slot(model, adapter_dirs):
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8)
    registry.load("a", adapter_dirs["a"], pin=True)
    registry.load("b", adapter_dirs["b"])
    registry.release(registry.acquire("a"))
    with pytest.raises(NoFreeLoRASlot):
        registry.acquire("b")
    registry.pin("a", False)
    registry.release(registry.acquire("b"))
    assert registry.slot_of("a") is None


def test_cpu_cache_eviction_rereads_the_same_file_or_refuses_a_changed_one(model, adapter_dirs, tmp_path):
    import shutil

    ids = random_ids(20, 320, seed=4)
    local = tmp_path / "a"
    shutil.copytree(adapter_dirs["a"], local)
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    registry.load("a", local)
    registry.load("b", adapter_dirs["b"])  # evicts a from the CPU cache
    assert registry.stats()["on_cpu"] == 1
    runner = CachedRunner(model, num_slots=2, num_pages=16, adapters=registry)
    seq = runner.add("a")  # read again from disk
    (got,) = runner.step([(seq, ids)])
    assert (got - reference(model, adapter_dirs["a"], ids)[-1]).abs().max().item() <= ATOL
    runner.release(seq)
    runner.release(runner.add("b"))  # a leaves the device and the CPU cache
    shutil.copy(adapter_dirs["c"] / "adapter_model.safetensors", local / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="changed on disk since it was loaded"):
        runner.add("a")


def test_an_edited_adapter_config_after_eviction_is_refused_not_served(model, adapter_dirs, tmp_path):
    """Only adapter_config.json changes (lora_alpha): the version read again is not the one loaded,
    so it is refused (409 through the server) instead of served with another scale."""
    import json
    import shutil

    local = tmp_path / "a"
    shutil.copytree(adapter_dirs["a"], local)
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    registry.load("a", local)
    registry.load("b", adapter_dirs["b"])  # evicts a from the CPU cache
    config = json.loads((local / "adapter_config.json").read_text())
    (local / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 2 * config["lora_alpha"]}))
    with pytest.raises(AdapterError, match="changed on disk since it was loaded"):
        registry.prepare("a")


def test_unknown_adapter_lists_what_is_loaded(model, adapter_dirs):
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8)
    registry.load("a", adapter_dirs["a"])
    with pytest.raises(UnknownAdapter, match="no adapter named 'zzz' is loaded \\(loaded: a\\)"):
        registry.acquire("zzz")
    with pytest.raises(UnknownAdapter):
        registry.unload("zzz")
