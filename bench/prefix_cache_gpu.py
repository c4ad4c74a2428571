"""Prefix caching on the 27B shape (issue 27): a follow-up turn on a long cached prompt, and a
multi-turn workload with a shared system prompt and 8 mixed adapters, with caching on and off.

    python3 bench/prefix_cache_gpu.py --layers 64 --out prefix.json      # H200, bf16, random weights
    python3 bench/prefix_cache_gpu.py --tiny                             # CPU smoke run of the same code

1. Follow-up: a 9,000-token prompt (standing in for an ≈8,800-visual-token video + its question:
   the decoder's share of the work; the tower is skipped by a cache hit too) answered with 32
   tokens, then the follow-up question on the same conversation. Time to first token of each
   turn, alone on the engine, with caching on; the first turn again with caching off.
2. Multi-turn: 32 conversations × 4 turns, a 2,000-token system prompt shared by all, a 64-token
   question per turn, 64 greedy tokens per answer (the history carries the generated tokens),
   conversation i on adapter i % 8; the turns of all conversations arrive together. Output
   tokens per second with caching on and off, and the prefix-cache hit rate.

Token ids are synthetic (random ids around `<|im_start|>` turn markers); the weights are random.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, random_adapters, random_model  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.tokenizer import load_tokenizer  # noqa: E402

TINY = dict(QWEN36_27B, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1024,
            rope_parameters=dict(QWEN36_27B["rope_parameters"], mrope_section=[2, 1, 1]))  # fmt: skip


def turn_ids(tokens: dict[str, int], role: str, body: list[int], close: bool = True) -> list[int]:
    """<|im_start|>role\\n body <|im_end|>\\n, in ids (role and newline as their own ids)."""
    out = [tokens["<|im_start|>"], tokens[role], tokens["\n"], *body]
    return out + ([tokens["<|im_end|>"], tokens["\n"]] if close else [])


def random_ids(n: int, seed: int, vocab: int = 600) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def run_until_done(engine: LLMEngine, requests: list[tuple]) -> tuple[dict, dict[str, float]]:
    """Submit all, step until all finished; (final outputs, time to first token of each, and the
    engine steps it took under key `steps:<id>`)."""
    start, steps = time.perf_counter(), 0
    for rid, prompt, params, adapter in requests:
        engine.add_request(rid, prompt, params, adapter)
    done, first = {}, {}
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
                first[f"steps:{out.request_id}"] = steps
            if out.finished:
                done[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done, first


def follow_up(engine: LLMEngine, tokens: dict[str, int], caching: bool, long: int) -> dict:
    engine.scheduler.prefix = engine.prefix_cache if caching else None
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    gen = [tokens["<|im_start|>"], tokens["assistant"], tokens["\n"]]
    first_prompt = turn_ids(tokens, "user", random_ids(long, seed=1)) + gen
    out1, ttft1 = run_until_done(engine, [("turn1", first_prompt, params, None)])
    history = first_prompt[: -len(gen)] + turn_ids(tokens, "assistant", out1["turn1"].token_ids)
    second_prompt = history + turn_ids(tokens, "user", random_ids(40, seed=2)) + gen
    hits = engine.prefix_cache.stats.hits if engine.prefix_cache else 0
    out2, ttft2 = run_until_done(engine, [("turn2", second_prompt, params, None)])
    reused = (engine.prefix_cache.stats.hits if engine.prefix_cache else 0) - hits
    history = second_prompt[: -len(gen)] + turn_ids(tokens, "assistant", out2["turn2"].token_ids)
    third_prompt = history + turn_ids(tokens, "user", random_ids(40, seed=3)) + gen
    _, ttft3 = run_until_done(engine, [("turn3", third_prompt, params, None)])
    return {
        "caching": caching,
        "first_turn_tokens": len(first_prompt),
        "follow_up_tokens": len(second_prompt),
        "ttft_first_s": ttft1["turn1"],
        "ttft_follow_up_s": ttft2["turn2"],
        "ttft_second_follow_up_s": ttft3["turn3"],
        "follow_up_over_first": ttft2["turn2"] / ttft1["turn1"],
        "steps_to_first_token": [ttft1["steps:turn1"], ttft2["steps:turn2"], ttft3["steps:turn3"]],
        "reused_tokens": reused,
    }


def multi_turn(engine: LLMEngine, tokens: dict[str, int], caching: bool, convs: int, turns: int, system: int) -> dict:
    engine.scheduler.prefix = engine.prefix_cache if caching else None
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        queries, hits = engine.prefix_cache.stats.queries, engine.prefix_cache.stats.hits
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    gen = [tokens["<|im_start|>"], tokens["assistant"], tokens["\n"]]
    system_turn = turn_ids(tokens, "system", random_ids(system, seed=3))
    histories = [list(system_turn) for _ in range(convs)]
    generated, wall = 0, 0.0
    for t in range(turns):
        requests = []
        for c in range(convs):
            histories[c] += turn_ids(tokens, "user", random_ids(64, seed=100 * c + t))
            requests.append((f"c{c}-t{t}-{caching}", histories[c] + gen, params, f"a{c % 8}"))
        t0 = time.perf_counter()
        done, _ = run_until_done(engine, requests)
        wall += time.perf_counter() - t0
        for c in range(convs):
            out = done[f"c{c}-t{t}-{caching}"]
            generated += len(out.token_ids)
            histories[c] += turn_ids(tokens, "assistant", out.token_ids)
    row = {"caching": caching, "conversations": convs, "turns": turns, "wall_s": wall, "out_tok_s": generated / wall}
    if caching and engine.prefix_cache is not None:
        s = engine.prefix_cache.stats
        row["hit_rate"] = (s.hits - hits) / max(1, s.queries - queries)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the bench runs")
    ap.add_argument("--skip-multi-turn", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else dict(QWEN36_27B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_hf(shape)
    work = Path(tempfile.mkdtemp())
    (work / "tok").mkdir()
    write_tokenizer(work / "tok", 1024)
    vocab = load_tokenizer(work / "tok").get_vocab()
    tokens = {t: vocab[t] for t in ("<|im_start|>", "<|im_end|>")}
    # role names as one id each (any ids do: the weights are random)
    tokens |= {"\n": vocab["Ċ"], "user": vocab["u"], "assistant": vocab["a"], "system": vocab["s"]}
    model = random_model(cfg, device, torch.float32 if args.tiny else torch.bfloat16)
    adapters = random_adapters(work, cfg)
    long, convs, turns, system = (600, 6, 3, 200) if args.tiny else (9000, 32, 4, 2000)
    config = EngineConfig(
        max_model_len=12288, max_num_seqs=32, max_num_batched_tokens=8192, max_loras=8, max_lora_rank=16,
        prefix_cache_states=3 * convs, device=device,
    )  # fmt: skip
    t0 = time.perf_counter()
    engine = LLMEngine(work / "tok", config, adapters, progress=False, model=model)
    result = {
        "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layers": cfg.num_layers,
        "date": time.strftime("%Y-%m-%d"),
        "engine_setup_s": time.perf_counter() - t0,
        "follow_up": [],
        "multi_turn": [],
    }
    print(f"engine set-up {result['engine_setup_s']:.1f} s", flush=True)
    run_until_done(engine, [("warm", random_ids(64, seed=9), SamplingParams(max_tokens=4), "a0")])
    for caching in (True, False):
        row = follow_up(engine, tokens, caching, long)
        result["follow_up"].append(row)
        print(row, flush=True)
    for caching in () if args.skip_multi_turn else (False, True):
        row = multi_turn(engine, tokens, caching, convs, turns, system)
        result["multi_turn"].append(row)
        print(row, flush=True)
    if result["multi_turn"]:
        off, on = result["multi_turn"]
        result["multi_turn_speedup"] = on["out_tok_s"] / off["out_tok_s"]
        print(f"multi-turn: caching on {result['multi_turn_speedup']:.2f}x caching off", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
