"""Task routing rules, the task-map file, engine config from the environment, and CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hylora.engine.config import EngineConfig
from hylora.kernels import KernelsConfig
from hylora.server.routing import ConflictError, RouteError, TaskRouter


class FakeRegistry:
    def __init__(self, names):
        self._names = names

    def names(self):
        return sorted(self._names)


def test_task_map_file_and_resolution(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"relic": "relic-v2", "tomb": "tomb", "lost": "gone"}))
    router = TaskRouter("base", FakeRegistry({"relic-v2", "tomb"}), TaskRouter.read_task_map(path))
    assert router.resolve(None, "relic") == "relic-v2"
    assert router.resolve("relic-v2", "relic") == "relic-v2"
    assert router.resolve("base", "tomb") == "tomb"
    assert router.resolve(None, None) is None and router.resolve("base", None) is None
    assert router.resolve("tomb", None) == "tomb"
    with pytest.raises(RouteError, match="maps to adapter 'gone', which is not loaded"):
        router.resolve(None, "lost")
    with pytest.raises(RouteError, match="unknown task 'mural'; tasks: lost, relic, tomb"):
        router.resolve(None, "mural")
    with pytest.raises(RouteError, match="models: base, relic-v2, tomb"):
        router.resolve("mural", None)
    with pytest.raises(ConflictError):
        router.resolve("tomb", "relic")


def test_bad_task_map_files(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        TaskRouter.read_task_map(tmp_path / "list.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        TaskRouter.read_task_map(tmp_path / "broken.json")


def test_the_environment_does_not_override_explicit_values(monkeypatch):
    """Knobs are flags: an environment variable never beats an explicit value (equal to the default or not)."""
    monkeypatch.setenv("HYLORA_MAX_NUM_SEQS", "64")
    assert EngineConfig(max_num_seqs=32).max_num_seqs == 32 and EngineConfig().max_num_seqs == 32
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="lora_backend must be one of"):
        KernelsConfig(lora_backend="fast")


def test_serve_reports_a_task_for_a_missing_adapter_without_traceback(causal_ckpt):
    out = subprocess.run(
        [sys.executable, "-m", "hylora", "serve", str(causal_ckpt[0]), "--device", "cpu", "--task", "relic=relic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "task 'relic' maps to adapter 'relic', which is not loaded" in out.stderr
    assert "Traceback" not in out.stderr


def test_repeated_list_flags_accumulate():
    """`--task a=x --task b=y` routes both tasks (docs/DEPLOY.md writes it so); as one list too."""
    import argparse

    from hylora.server.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["m", "--task", "relic=relic", "--task", "tomb=tomb", "mural=mural"])
    assert args.task == ["relic=relic", "tomb=tomb", "mural=mural"]
    args = p.parse_args(["m", "--allowed-media-domains", "a.example", "--allowed-media-domains", "b.example"])
    assert args.allowed_media_domains == ["a.example", "b.example"]
