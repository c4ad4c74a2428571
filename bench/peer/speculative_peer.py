"""vLLM 0.20.2 beside hylora with MTP speculative decoding (issue 26): decode tok/s at batch 1 / 8 / 32.

- Checkpoint: random bf16 weights of the Qwen3.6-27B text shape cut to 16 layers, with one MTP layer,
  arranged as `bench/speculative_gpu.py --arranged` arranges them: the MTP layer's drafts are the
  model's own next greedy tokens by a large margin. That is the one setting where both engines
  accept (nearly) every draft without trained weights, and where bf16 rounding turns no greedy
  choice. Hugging Face VL layout, `mtp.*` at the top level as Qwen's releases store it; vLLM's
  config.json (`Qwen3_5ForConditionalGeneration`, `mtp_num_hidden_layers` 1).
- Both engines: `{"method": "mtp", "num_speculative_tokens": K}` (default 2), max_num_seqs 32,
  max_num_batched_tokens 2048, max model length 1024, prefix caching off, no adapters, greedy.
- Workload per batch b: b requests x 512 random prompt ids + 128 tokens (ignore_eos), all at once,
  once untimed (vLLM's first run of batch 8 took 2.8 s in run 23, its second 0.66 s), then timed;
  then the same prompts with max_tokens=1. Decode tok/s = b x 127 / (wall - prefill wall), measured
  alike on both engines. hylora also runs the same batches without speculation (its drafter off on
  the same engine); vLLM's plain decode would need a second engine, which does not fit one call.
- Acceptance: drafted and accepted tokens from each engine's own counters (vLLM's `spec_decode`
  metrics from `LLM.get_metrics()`; hylora's engine stats).

Phases (each writes WORK/results/spec-<engine>.json, rewritten after every batch):

    ckpt                      the arranged checkpoint (--reuse keeps one an earlier call completed)
    vllm / hylora             one engine, every batch; --dry-run (vllm): vLLM's checks of its arguments
    table [--results DIR ...] the markdown table from every result found
    run STEP ...              steps in their own process groups under --budget, then the table

    bash bench/peer/speculative_gpu.sh        # H200, .vllm and .peerwhl carried: run ckpt vllm hylora
    python bench/peer/speculative_peer.py run ckpt hylora --tiny --device cpu --out /tmp/specpeer   # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peer import engine_phases as ep  # noqa: E402
from bench.peer import throughput_peer as tp  # noqa: E402

VERSION = "1"  # bump when the checkpoint changes: a reused work dir with another stamp is rewritten
BATCHES = (1, 8, 32)
PROMPT_LEN, NEW_TOKENS = 512, 128
MNBT = 2048
MIN_LEFT_S = {"ckpt": 60, "vllm": 240, "hylora": 150}
# vLLM's CUDA graphs: a verify step of b requests is b x (K + 1) tokens
CAPTURE_SIZES = sorted({b * m for b in (1, 2, 4, 8, 16, 24, 32) for m in (1, 2, 3, 4, 5)})


def log(*parts: object) -> None:
    tp.log(*parts)


def prompts(batch: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(100 + batch)
    return [torch.randint(0, 1000, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def ckpt_dir(work: Path) -> Path:
    return work / "ckpt-mtp-arranged"


def stamp(tiny: bool) -> str:
    return f"{VERSION} {'tiny' if tiny else f'27b-{tp.N_LAYERS}'}"


PREFIX = "spec"  # results: WORK/results/spec-<engine>.json


def save(work: Path, data: dict[str, Any]) -> None:
    ep.save(work, PREFIX, data)


def new_result(engine: str, k: int, packages: tuple[str, ...]) -> dict[str, Any]:
    date = time.strftime("%Y-%m-%d %H:%M")
    return {"engine": engine, "k": k, "date": date, "versions": tp.versions(packages), "rows": []}


def decode_row(batch: int, mode: str, wall_s: float, prefill_s: float, **extra: Any) -> dict[str, Any]:
    decode_s = max(wall_s - prefill_s, 1e-9)
    return {"batch": batch, "mode": mode, "wall_s": wall_s, "prefill_s": prefill_s,
            "decode_tok_s": batch * (NEW_TOKENS - 1) / decode_s, **extra}  # fmt: skip


# --------------------------------------------------------------------------------------------
# phase ckpt


def phase_ckpt(args: argparse.Namespace) -> None:
    import torch

    from bench import engine_gpu as eg
    from bench.speculative_gpu import arrange
    from hylora.config import ModelConfig
    from hylora.demo import write_tokenizer

    work, ckpt = args.work, ckpt_dir(args.work)
    done = work / "ckpt-mtp-arranged.complete"
    if args.reuse and done.is_file() and done.read_text().strip() == stamp(args.tiny):
        log(f"reusing {ckpt}")
        return
    done.unlink(missing_ok=True)
    t0 = time.perf_counter()
    shape = dict(tp.model_shape(args.tiny), mtp_num_hidden_layers=1)
    tok = work / "tok"
    tok.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tok, 1024)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = eg.random_model(ModelConfig.from_hf(shape), args.device, dtype, mtp=True)
    arrange(model)
    shutil.rmtree(ckpt, ignore_errors=True)
    eg.write_checkpoint(model.to(torch.bfloat16), shape, tok, ckpt)
    del model
    tp.vllm_style_config(ckpt)
    done.write_text(stamp(args.tiny) + "\n")
    log(f"arranged checkpoint with an MTP layer written to {ckpt} in {time.perf_counter() - t0:.0f}s")


# --------------------------------------------------------------------------------------------
# phase vllm


def vllm_kwargs(ckpt: Path, k: int, attention_backend: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=str(ckpt),
        skip_tokenizer_init=True,
        language_model_only=True,
        dtype="bfloat16",
        max_model_len=tp.MAX_MODEL_LEN,
        max_num_seqs=tp.MAX_NUM_SEQS,
        max_num_batched_tokens=MNBT,
        enable_prefix_caching=False,
        gpu_memory_utilization=tp.GPU_MEMORY_UTILIZATION,
        gdn_prefill_backend="triton",
        compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES},
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        disable_log_stats=False,  # else LLM.get_metrics() has no spec_decode counters
        seed=0,
    )
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def vllm_spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's spec_decode counters (drafts, draft tokens, accepted tokens), summed over labels."""
    found: dict[str, float] = {}
    with contextlib.suppress(Exception):
        for m in llm.get_metrics():
            if "spec_decode" in m.name and hasattr(m, "value"):
                found[m.name] = found.get(m.name, 0.0) + float(m.value)
    return found


def phase_vllm(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not importable here (bench/peer/speculative_gpu.sh installs the carried one)")
    work = args.work
    data = new_result("vllm", args.k, ("vllm", "torch", "triton", "transformers"))
    notes: Any = ep.Notes(data)  # takes the place of throughput_peer's Record
    backend = args.attention_backend or tp.attention_fallback(tp.Work(work), notes, write_stub=not args.dry_run)
    kwargs = vllm_kwargs(ckpt_dir(work), args.k, backend)
    data["settings"] = {k: v for k, v in kwargs.items() if k != "model"}
    if args.dry_run:
        tp.check_vllm_args(kwargs)
        return
    save(work, data)
    try:
        run_vllm(work, kwargs, data)
    except BaseException as e:
        data["error"] = f"{type(e).__name__}: {e}"[:2000]
        save(work, data)
        raise


def run_vllm(work: Path, kwargs: dict[str, Any], data: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    log("LLM(", kwargs, ")")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    data.update(startup_s=time.perf_counter() - t0, card=tp.card("cuda"))
    save(work, data)
    full = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts(1)[0][:16])], full, use_tqdm=False)  # warm-up
    for b in BATCHES:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts(b)]
        llm.generate(inputs, full, use_tqdm=False)  # warm-up: a batch's first run compiles its shapes
        before = vllm_spec_counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(inputs, full, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = vllm_spec_counters(llm)
        t0 = time.perf_counter()
        llm.generate(inputs, first, use_tqdm=False)
        prefill = time.perf_counter() - t0
        counters = {k: after[k] - before.get(k, 0.0) for k in after}
        row = decode_row(b, "mtp", wall, prefill, counters=counters,
                         first_tokens=[list(o.outputs[0].token_ids[:6]) for o in outs[:2]])  # fmt: skip
        data["rows"].append(row)
        log(f"vLLM mtp batch {b}: {row['decode_tok_s']:.0f} decode tok/s, counters {counters}")
        save(work, data)
    data["complete"] = True
    save(work, data)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------
# phase hylora


def hylora_generate(engine: Any, batch: int, max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """All of the batch's prompts at once; (wall s until the last finishes, the first two outputs)."""
    from hylora.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{max_tokens}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    tp.sync(device)
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts(batch), strict=True):
        engine.add_request(rid, p, params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    tp.sync(device)
    return time.perf_counter() - t0, [done[r].token_ids[:6] for r in ids[:2]]


def phase_hylora(args: argparse.Namespace) -> None:
    import torch

    from hylora.engine import EngineConfig, LLMEngine
    from hylora.kernels import as_text
    from hylora.model.loader import load_model

    work, device = args.work, args.device
    if device == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    data = new_result("hylora", args.k, ("torch", "triton", "transformers", "fla-core"))
    config = EngineConfig(
        max_model_len=tp.MAX_MODEL_LEN, max_num_seqs=tp.MAX_NUM_SEQS, max_num_batched_tokens=MNBT,
        dtype=str(dtype).removeprefix("torch."), device=device, enable_prefix_caching=False,
        num_speculative_tokens=args.k, padded_decode=device == "cpu",
    )  # fmt: skip
    t0 = time.perf_counter()
    ckpt = ckpt_dir(work)
    model = load_model(ckpt, dtype=dtype, device=device, progress=False, vision=False, mtp=True)
    engine = LLMEngine(ckpt, config, progress=False, model=model)
    tp.sync(device)
    drafter = engine.drafter
    data.update(startup_s=time.perf_counter() - t0, card=tp.card(device), kernels=as_text(engine.kernels))
    save(work, data)
    hylora_generate(engine, 1, 8, device)  # warm-up
    for b in BATCHES:
        for mode in ("mtp", "plain"):
            engine.drafter = drafter if mode == "mtp" else None
            hylora_generate(engine, b, NEW_TOKENS, device)  # warm-up, as vLLM's
            before = engine.stats()
            wall, firsts = hylora_generate(engine, b, NEW_TOKENS, device)
            after = engine.stats()
            prefill, _ = hylora_generate(engine, b, 1, device)
            counters = {
                "draft_tokens": after.spec_draft_tokens - before.spec_draft_tokens,
                "accepted_tokens": after.spec_accepted_tokens - before.spec_accepted_tokens,
            }
            row = decode_row(b, mode, wall, prefill, counters=counters, first_tokens=firsts)
            data["rows"].append(row)
            log(f"hylora {mode} batch {b}: {row['decode_tok_s']:.0f} decode tok/s, counters {counters}")
            save(work, data)
    engine.drafter = drafter
    data["complete"] = True
    save(work, data)


# --------------------------------------------------------------------------------------------
# phase table


def row_of(data: dict[str, Any] | None, batch: int, mode: str) -> dict[str, Any] | None:
    rows = [r for r in (data or {}).get("rows", []) if r["batch"] == batch and r["mode"] == mode]
    return rows[-1] if rows else None


def acceptance(row: dict[str, Any] | None) -> str:
    """Accepted / drafted tokens from the engine's own counters."""
    c = (row or {}).get("counters") or {}
    drafted = c.get("draft_tokens", next((v for k, v in c.items() if k.endswith("num_draft_tokens")), None))
    accepted = c.get("accepted_tokens", next((v for k, v in c.items() if k.endswith("num_accepted_tokens")), None))
    return f"{accepted / drafted:.2f}" if drafted and accepted is not None else "–"


def table_md(found: dict[str, dict[str, Any]]) -> str:
    vl, hy = found.get("vllm"), found.get("hylora")
    k = (hy or vl or {}).get("k", "?")
    cards = sorted({d["card"] for d in found.values() if d.get("card")})
    lines = [
        f"# vLLM 0.20.2 beside hylora, MTP speculative decoding (k = {k})",
        "",
        f"Card: {', '.join(cards) or '–'}; measured {', '.join(sorted(d['date'][:10] for d in found.values()))}. "
        "Random bf16 weights of the 27B text shape cut to 16 layers with one MTP layer, arranged so that the MTP "
        "layer drafts the model's own next greedy token (both engines accept nearly every draft). Per batch b: b x "
        f"{PROMPT_LEN} prompt ids + {NEW_TOKENS} greedy tokens, all at once; decode tok/s = b x {NEW_TOKENS - 1} / "
        "(wall - the same prompts' max_tokens=1 wall). Acceptance: accepted / drafted tokens, each engine's counters.",
        "",
        "| batch | vLLM + MTP | hylora + MTP | hylora / vLLM | hylora plain | hylora MTP / plain "
        "| acceptance vLLM / hylora |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in BATCHES:
        v, h, p = row_of(vl, b, "mtp"), row_of(hy, b, "mtp"), row_of(hy, b, "plain")

        def tok(r: dict[str, Any] | None) -> str:
            return f"{r['decode_tok_s']:.0f}" if r else "–"

        def rat(a: dict[str, Any] | None, c: dict[str, Any] | None) -> str:
            return f"{a['decode_tok_s'] / c['decode_tok_s']:.2f}" if a and c else "–"

        lines.append(f"| {b} | {tok(v)} | {tok(h)} | {rat(h, v)} | {tok(p)} | {rat(h, p)} "
                     f"| {acceptance(v)} / {acceptance(h)} |")  # fmt: skip
    lines += ["", *ep.status_rows(found, {})]
    return "\n".join(lines) + "\n"


def phase_table(args: argparse.Namespace) -> None:
    ep.phase_table(args, PREFIX, table_md, "speculative_peer.md")


def phase_run(args: argparse.Namespace) -> None:
    ep.phase_run(args, Path(__file__).resolve(), MIN_LEFT_S, ["--k", str(args.k)])
    phase_table(args)


PHASES = {
    "ckpt": phase_ckpt,
    "vllm": phase_vllm,
    "hylora": ep.guarded(phase_hylora, PREFIX, "rows"),
    "table": phase_table,
    "run": phase_run,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def add(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")

    return ep.parse_args(__doc__, list(PHASES), "/tmp/specpeer_out", add, argv)


def main() -> None:
    tp.run_phase(PHASES, parse_args())


if __name__ == "__main__":
    main()
