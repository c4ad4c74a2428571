"""`hylora doctor` against two OpenAI-compatible servers on the same checkpoint and adapters:
vLLM 0.20.2 (`vllm serve`) and hylora (`hylora serve`), in one run on one GPU.

1. Inputs (hylora's demo writer and PEFT): a random-weight checkpoint of the real architecture in
   the Hugging Face VL layout (`model.language_model.*` keys, a small vision tower, fp32), by
   default the Qwen3.6-27B head shapes at hidden size 1024 cut to 4 layers (3 Gated DeltaNet + 1
   full attention); three adapters written by PEFT with small, real effects (like task adapters);
   and a fourth whose keys are the text model's (`base_model.model.model.layers.N…`, what a
   fine-tune of the text-only model saves) instead of the VL wrapper's
   (`base_model.model.model.language_model.layers.N…`).
2. Both servers serve the checkpoint in bf16; doctor computes its reference in-process with
   hylora in fp32 and judges each server (tolerance from the server's measured noise).
3. Expected: hylora passes everything; vLLM 0.20.2 maps no module of the text-keyed adapter onto
   its model and serves the base model under its name (doctor: "served the base model under the
   name 'textkeys'").

Each server runs in its own process group, is polled on /v1/models until ready, and is killed at
the end; every phase has a deadline inside `--budget`, so a stuck phase still leaves the others'
results. Writes OUT/peer_doctor.md (the summary table), OUT/<engine>/doctor.json, doctor.html
and server.log.

    python3 bench/peer/doctor_peer.py --out $OUT --budget 500                    # GPU: both engines
    python3 bench/peer/doctor_peer.py --tiny --device cpu --engines hylora --out /tmp/peer   # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peer.child_env import child_env  # noqa: E402
from hylora.demo import DemoShape  # noqa: E402

# the Qwen3.6-27B head shapes (head_dim 256, GDN heads 128 wide, 1 attention layer in 4) at hidden size 1024
SHAPES = {
    "small": DemoShape(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=4,
        linear_num_value_heads=12,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "tiny": DemoShape(num_hidden_layers=4),  # the demo's own shape, 4 layers: the CPU dry run
}
INPUTS_VERSION = "1"  # bump when the inputs change: a reused work dir with another version is rewritten
RANK = 16  # --max-lora-rank of both servers (vLLM accepts 1, 8, 16, 32, 64, …)
# name -> (PEFT LoraConfig kwargs, factor on PEFT's random lora_B): mean |Δ logprob| vs base of a few tenths
ADAPTERS: dict[str, tuple[dict[str, Any], float]] = {
    "subtle_attn": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"]), 0.3),
    "subtle_mlp": (dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]), 0.25),
    "subtle_all": (
        dict(r=16, lora_alpha=16, use_rslora=True, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
            "out_proj", "gate_proj", "up_proj", "down_proj",
        ]),
        0.1,
    ),
    "textkeys": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                                                          "gate_proj", "up_proj", "down_proj"]), 0.35),
}  # fmt: skip
TEXT_KEYED = "textkeys"  # saved with the text model's keys (rewritten after PEFT saved it)
ENGINES = ("vllm", "hylora")


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# --------------------------------------------------------------------------------------------
# inputs


@dataclass
class Inputs:
    ckpt: Path
    adapters: dict[str, Path]


def write_inputs(work: Path, shape: str, reuse: bool, peft: bool = True) -> Inputs:
    """The checkpoint and the four adapters under `work` (kept when `reuse` and already complete)."""
    ckpt, root = work / "ckpt", work / "adapters"
    adapters = {name: root / name for name in ADAPTERS}
    marker = work / "INPUTS_COMPLETE"
    stamp = f"{INPUTS_VERSION} {shape}"
    if reuse and marker.is_file() and marker.read_text().strip() == stamp:
        log(f"reusing the checkpoint and adapters in {work}")
        return Inputs(ckpt, adapters)
    t0 = time.perf_counter()
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    write_checkpoint(ckpt, SHAPES[shape])
    log(f"checkpoint ({shape}) written to {ckpt} in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    try:
        if not peft:
            raise RuntimeError("--no-peft")
        write_peft_adapters(ckpt, adapters)
    except Exception as e:  # noqa: BLE001 (PEFT missing or broken on this machine: the same files by hand)
        log(f"adapters without PEFT ({type(e).__name__}: {e})")
        write_adapters_by_hand(ckpt, adapters)
    rekey_to_text_model(adapters[TEXT_KEYED])
    log(f"adapters {', '.join(adapters)} written in {time.perf_counter() - t0:.1f}s")
    marker.write_text(stamp + "\n")
    return Inputs(ckpt, adapters)


def write_checkpoint(path: Path, shape: DemoShape) -> None:
    """hylora's demo writer at `shape`: tokenizer, VL config, fp32 random weights (tower and MTP layer
    included). Its media (PyAV, absent on the GPU machine) and its own adapters are left out."""
    import hylora.demo as demo

    with mock.patch.object(demo, "write_demo_media", lambda _path: None):
        demo.write_demo(path, shape)
    shutil.rmtree(path / "adapters")


def write_peft_adapters(ckpt: Path, paths: dict[str, Path]) -> None:
    """Each adapter of ADAPTERS written by PEFT on the transformers model of `ckpt`: random A and a
    small random B (init_lora_weights=False, B scaled down): small effects, as task adapters have."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32)
    for i, (name, (kwargs, factor)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        model = get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(factor)
        model.save_pretrained(paths[name])


def write_adapters_by_hand(ckpt: Path, paths: dict[str, Path]) -> None:
    """What write_peft_adapters writes, without PEFT: the same keys and config fields, A and B drawn
    as PEFT's init_lora_weights=False leaves them (nn.Linear's U(±1/sqrt(fan_in))), B scaled down."""
    import math

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shapes = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                if key.startswith("model.language_model.layers.") and key.endswith(".weight"):
                    shapes[key] = f.get_slice(key).get_shape()
    for i, (name, (kwargs, factor)) in enumerate(ADAPTERS.items()):
        g, r = torch.Generator().manual_seed(100 + i), kwargs["r"]
        tensors = {}
        for key, shape in shapes.items():
            if key.rsplit(".", 2)[-2] not in kwargs["target_modules"] or len(shape) != 2:
                continue
            (out_f, in_f), prefix = shape, "base_model.model." + key.removesuffix(".weight")
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand(r, in_f, generator=g) * 2 - 1) / math.sqrt(in_f)
            tensors[f"{prefix}.lora_B.weight"] = (torch.rand(out_f, r, generator=g) * 2 - 1) * factor / math.sqrt(r)
        paths[name].mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(paths[name] / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA", "task_type": None, "base_model_name_or_path": str(ckpt), "r": r,
            "lora_alpha": kwargs["lora_alpha"], "use_rslora": kwargs.get("use_rslora", False),
            "target_modules": kwargs["target_modules"], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "modules_to_save": None, "init_lora_weights": False, "use_dora": False, "inference_mode": True,
        }  # fmt: skip
        (paths[name] / "adapter_config.json").write_text(json.dumps(config, indent=2))


def rekey_to_text_model(path: Path) -> None:
    """`…model.language_model.layers.N…` -> `…model.layers.N…`: the keys of an adapter trained on the
    text-only model (hylora maps both onto the decoder; vLLM 0.20.2's VL model matches none)."""
    from safetensors.torch import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    rekeyed = {k.replace(".language_model.layers.", ".layers."): v for k, v in tensors.items()}
    if rekeyed.keys() == tensors.keys():
        raise RuntimeError(f"{file}: no VL keys to rewrite (PEFT saved {next(iter(tensors))})")
    save_file(rekeyed, str(file), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when the process that started it dies (a phase killed at
    its deadline would otherwise leave its server holding the GPU). Linux only; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Server:
    """One OpenAI-compatible server in its own process group, its output in `log_path`."""

    engine: str
    cmd: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        """Starts the server and a thread that polls GET /v1/models from now on, so `ready_s` is when it
        first answered even while the driver is busy with the other engine."""
        log(f"{self.engine}: starting: {' '.join(self.cmd)}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        out.close()
        threading.Thread(target=self._watch_ready, daemon=True).start()

    def _watch_ready(self) -> None:
        assert self.proc is not None
        while self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        log(f"{self.engine}: ready in {self.ready_s:.0f}s: {r.read().decode()[:300]}")
                        return
            except OSError:
                pass
            time.sleep(1)

    def wait_ready(self, deadline: float) -> str | None:
        """Waits until the server has answered GET /v1/models; returns why not (exited, deadline) or None."""
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.ready_s is not None:
                return None
            if self.proc.poll() is not None:
                return f"exited with code {self.proc.returncode} before it was ready (see {self.log_path.name})"
            time.sleep(0.5)
        return f"not ready after {time.monotonic() - self.started:.0f}s"

    def stop(self) -> None:
        """SIGTERM to the whole group (vLLM's engine core is a child), SIGKILL after 10 s."""
        if self.proc is None or self.proc.returncode is not None:
            return
        kill_group(self.proc, 10)
        log(f"{self.engine}: stopped")


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # the group's other members (vLLM's engine core) outlive its leader
        os.killpg(proc.pid, signal.SIGKILL)


def lora_flags(inputs: Inputs) -> list[str]:
    return ["--lora-modules", *(f"{name}={path}" for name, path in inputs.adapters.items())]


def vllm_server(inputs: Inputs, args: argparse.Namespace, out: Path) -> Server:
    """`vllm serve` as fast to start as it goes (correctness, not speed): no torch.compile, no CUDA
    graphs (-O0, --enforce-eager), the vision tower not built, a fixed KV budget (no memory
    profiling, so hylora's server may start beside it), Triton's GDN prefill (FlashInfer's is
    not carried)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(inputs.ckpt),
        "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--seed", "0",
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", str(len(inputs.adapters)),
        *lora_flags(inputs),
        "--enforce-eager", "-O0", "--language-model-only", "--gdn-prefill-backend", "triton",
        "--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", "4G",
        "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return Server("vllm", cmd + args.vllm_arg, port, out / "vllm" / "server.log")


def hylora_server(inputs: Inputs, args: argparse.Namespace, out: Path) -> Server:
    """`hylora serve` with its defaults (CUDA graphs, prefix caching), KV pages given so that it
    sizes nothing from the GPU's free memory (vLLM may be starting beside it)."""
    port = free_port()
    pages = 16 * -(-args.max_model_len // 16) + 64  # 16 sequences of the longest prompt, 16-token pages
    cmd = [
        sys.executable, "-m", "hylora", "serve", str(inputs.ckpt),
        "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--seed", "0",
        "--max-lora-rank", str(RANK), "--max-loras", str(len(inputs.adapters)),
        *lora_flags(inputs),
        "--num-pages", str(pages), "--device", args.device,
        "--enable-prompt-tokens-details", "--disable-log-requests", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return Server("hylora", cmd + args.hylora_arg, port, out / "hylora" / "server.log")


# --------------------------------------------------------------------------------------------
# doctor


@dataclass
class EngineResult:
    engine: str
    ready_s: float | None = None
    doctor_s: float | None = None
    exit_code: int | None = None
    error: str | None = None
    report: dict[str, Any] | None = None
    text: list[str] = field(default_factory=list)  # doctor's terminal report


def run_doctor(server: Server, inputs: Inputs, args: argparse.Namespace, out: Path, deadline: float) -> EngineResult:
    res = EngineResult(server.engine, ready_s=server.ready_s)
    folder = out / server.engine
    left = deadline - time.monotonic()
    cmd = [
        sys.executable, "-m", "hylora", "doctor", str(inputs.ckpt), *lora_flags(inputs),
        "--endpoint", server.url, "--served-model-name", "base",
        "--dtype", "float32", "--device", args.device, "--max-model-len", str(args.max_model_len),
        "--request-timeout", "120", "--time-limit", f"{max(left - 20, 30):.0f}",
        "--json", str(folder / "doctor.json"), "--report", str(folder / "doctor.html"),
    ]  # fmt: skip
    if args.device == "cpu":
        cmd += ["--threads", "1"]
    log(f"{server.engine}: doctor: {' '.join(cmd)}")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    prefix = f"{server.engine} doctor |"
    relays = [
        threading.Thread(target=_relay, args=(proc.stdout, prefix, res.text), daemon=True),  # the report
        threading.Thread(target=_relay, args=(proc.stderr, prefix, None), daemon=True),  # progress, logs
    ]
    for relay in relays:
        relay.start()
    try:
        res.exit_code = proc.wait(timeout=max(left, 1))
    except subprocess.TimeoutExpired:
        res.error = f"doctor killed at the deadline after {time.monotonic() - t0:.0f}s"
        kill_group(proc, 5)
    for relay in relays:
        relay.join(timeout=5)
    res.doctor_s = time.monotonic() - t0
    report = folder / "doctor.json"
    if report.is_file():
        res.report = json.loads(report.read_text())
    elif res.error is None:
        res.error = f"doctor exited with code {res.exit_code} without a report"
    log(f"{server.engine}: doctor exit {res.exit_code} in {res.doctor_s:.0f}s {res.error or ''}")
    return res


def _relay(stream: IO[str], prefix: str, keep: list[str] | None) -> None:
    """Copies a child's output stream to ours, line by line with a prefix (and into `keep`)."""
    for line in stream:
        print(prefix, line.rstrip(), flush=True)
        if keep is not None:
            keep.append(line.rstrip())


def run_engine(server: Server, inputs: Inputs, args: argparse.Namespace, out: Path, deadline: float) -> EngineResult:
    """Wait for the started server, run doctor against it, stop it."""
    try:
        why = server.wait_ready(max(deadline - args.doctor_reserve, time.monotonic() + 30))
        if why is not None:
            log(f"{server.engine}: {why}")
            return EngineResult(server.engine, error=f"server {why}")
        return run_doctor(server, inputs, args, out, deadline)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# summary


def expected(engine: str, target: str) -> str:
    if engine == "vllm" and target == TEXT_KEYED:
        return "FAIL: base model under its name"
    return "pass"


def target_rows(res: EngineResult, targets: list[str]) -> list[tuple[str, str, str, str]]:
    """(engine, target, verdict, detail) per target: FAIL with the checks whose failures name it."""
    if res.report is None:
        return [(res.engine, t, "no report", res.error or "") for t in targets]
    checks = res.report["checks"]
    effect = next((c for c in checks if c["name"] == "adapter_effect"), None)
    rows = []
    for target in targets:
        failed, first = [], ""
        for c in checks:
            mine = [f for f in c["failures"] if f.startswith((f"{target}:", f"{target} ", f"{target},"))]
            if mine:
                failed.append(c["name"])
                first = first or mine[0]
        if effect is not None and target in effect["data"]:
            a = effect["data"][target]
            carried = f", carries {a['carried']:.2f}" if a.get("carried") is not None else ""
            detail = f"effect {a['effect_mean']:.2g} (noise {a['noise']:.2g}{carried})"
        else:
            detail = ""
        if failed:
            why = "base model under its name" if "served the base model" in first else first[len(target) + 1 :][:90]
            rows.append((res.engine, target, "FAIL: " + ", ".join(failed), f"{why.strip()}; {detail}".strip("; ")))
        else:
            rows.append((res.engine, target, "pass", detail))
    return rows


def summary(results: list[EngineResult], inputs: Inputs, args: argparse.Namespace, elapsed: float) -> str:
    targets = ["base", *inputs.adapters]
    lines = [
        f"# hylora doctor against vLLM 0.20.2 and hylora ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Checkpoint: {args.shape} shape, fp32 on disk, served in bf16; reference: hylora fp32 on {args.device}; "
        f"max model len {args.max_model_len}; adapter `{TEXT_KEYED}` saved with text-model keys.",
        "",
        "| engine | target | verdict | expected | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for engine, target, verdict, detail in target_rows(res, targets):
            lines.append(f"| {engine} | {target} | {verdict} | {expected(engine, target)} | {detail} |")
    header = "| engine | server ready | doctor | exit | checks failed | error |"
    lines += ["", header, "|" + " --- |" * 6]
    for res in results:
        failed = [c["name"] for c in (res.report or {}).get("checks", []) if c["status"] == "fail"]
        ready = f"{res.ready_s:.0f} s" if res.ready_s is not None else "-"
        doctor = f"{res.doctor_s:.0f} s" if res.doctor_s is not None else "-"
        lines.append(
            f"| {res.engine} | {ready} | {doctor} | {res.exit_code} | {', '.join(failed) or '-'} | {res.error or ''} |"
        )
    lines += ["", f"Total {elapsed:.0f} s."]
    for res in results:
        if res.text:
            lines += ["", f"## {res.engine}: doctor's report", "", "```", *res.text, "```"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------


def versions() -> str:
    import importlib.metadata as md

    names = ["vllm", "torch", "triton", "transformers", "peft", "fastapi", "pydantic", "starlette", "uvicorn"]
    found = {}
    for name in [*names, "fla-core"]:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "-"
    return ", ".join(f"{k} {v}" for k, v in found.items())


def pick_work() -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 4e9 else Path("/tmp")
    return root / "hylora_peer"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/peer_out")))
    ap.add_argument("--work", type=Path, default=None, help="checkpoint and adapters (default /dev/shm or /tmp)")
    ap.add_argument("--budget", type=float, default=500, help="seconds for everything; phases get what is left")
    ap.add_argument("--engines", default="vllm,hylora", help="comma-separated: vllm, hylora")
    ap.add_argument("--tiny", action="store_true", help="the demo's shape (CPU dry run)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--max-model-len", type=int, default=None, help="both servers and doctor (default 2049; tiny 1025)")
    ap.add_argument("--serial", action="store_true", help="start each server at its turn (default on the CPU)")
    ap.add_argument("--reuse", action="store_true", help="keep the checkpoint and adapters of an earlier run")
    ap.add_argument("--no-peft", action="store_true", help="write the adapters' files without PEFT")
    ap.add_argument("--inputs-only", action="store_true", help="write the checkpoint and adapters, then stop")
    ap.add_argument("--doctor-reserve", type=float, default=90, help="seconds kept for doctor after a server's start")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more flag for vllm serve (repeatable)")
    ap.add_argument("--hylora-arg", action="append", default=[], help="one more flag for hylora serve (repeatable)")
    args = ap.parse_args()
    t0 = time.monotonic()
    deadline = t0 + args.budget - 10  # the summary's share
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = "tiny" if args.tiny else "small"
    args.max_model_len = args.max_model_len or (1025 if args.tiny else 2049)
    serial = args.serial or args.device == "cpu"
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}: pick from {ENGINES}")
    out, work = args.out, args.work or pick_work()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log(versions())
    log(f"work {work}, out {out}, budget {args.budget:.0f}s, engines {engines}, device {args.device}, serial {serial}")
    inputs = write_inputs(work, args.shape, args.reuse, peft=not args.no_peft)
    if args.inputs_only:
        return
    env = child_env(single_thread=args.device == "cpu")  # shared cores: one torch thread each
    builders = {"vllm": vllm_server, "hylora": hylora_server}
    servers = [builders[e](inputs, args, out) for e in engines]
    results: list[EngineResult] = []
    try:
        if not serial:  # all at once: neither server sizes its memory from what is free on the GPU
            for server in servers:
                server.start(env)
        for i, server in enumerate(servers):
            # one doctor at a time (its reference engine takes 90 % of the GPU's free memory); each
            # later engine keeps a share of the budget for its doctor (and its start-up, when serial)
            share = (150 if not serial else 210) * (len(servers) - 1 - i)
            if serial:
                server.start(env)
            results.append(run_engine(server, inputs, args, out, max(deadline - share, time.monotonic() + 60)))
    finally:
        for server in servers:
            server.stop()
    text = summary(results, inputs, args, time.monotonic() - t0)
    (out / "peer_doctor.md").write_text(text)
    print(text.split("\n## ")[0], flush=True)


if __name__ == "__main__":
    main()
