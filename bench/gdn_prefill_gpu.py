"""The GDN layer's prefill glue on the 27B shape, kernel by kernel (GPU):

1. the causal conv1d by slot (`ops.causal_conv1d.triton`, q | k | v split as the layer asks) at the
   prefill shapes of the throughput workload and of one long prompt: its error against the torch
   reference on the same inputs, µs per call and the rate it streams x in and the output out;
2. the recurrent state's gather and scatter around fla's chunked delta rule (`model/gdn.py`): fp32
   states [N, 48, 128, 128] out of and back into a [layers, slots, ...] pool, by advanced indexing
   (what the layer does) against `index_select` / `index_copy_` on the layer's view.

µs are the median of 10 replays of a CUDA graph of 20 calls (`bench.kernel_sweep_gpu.bench`).
Run it in two checkouts to compare a kernel change (same machine, one call):

    python3 bench/gdn_prefill_gpu.py [--cases 8192x1,8192x16,2048x4,512x1,47x32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep_gpu import bench  # noqa: E402
from bench.shapes import copy_rate  # noqa: E402
from hylora.ops.causal_conv1d import reference as conv_reference  # noqa: E402
from hylora.ops.causal_conv1d import triton as conv_triton  # noqa: E402

KEY, VALUE, IN_PROJ_TAIL = 2048, 6144, 6144 + 96  # q / k width, v width; the in_proj's z | b | a after qkv
HEADS, DK, DV, LAYERS = 48, 128, 128, 2


def lengths(tokens: int, seqs: int) -> list[int]:
    """`seqs` sequences over `tokens` tokens; 47x32: 31 decode rows and one 16-token chunk."""
    if tokens == seqs + 15:
        return [1] * (seqs - 1) + [16]
    return [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]


def conv_case(tokens: int, seqs: int, dev: str) -> str:
    g = torch.Generator(device=dev).manual_seed(tokens + seqs)
    C = 2 * KEY + VALUE
    lens = lengths(tokens, seqs)
    x = torch.randn(tokens, C + IN_PROJ_TAIL, device=dev, generator=g).bfloat16()[:, :C]
    weight = torch.randn(C, 4, device=dev, generator=g).bfloat16()
    slots = torch.randperm(seqs + 8, device=dev, generator=g)[:seqs]
    pool = torch.randn(seqs + 8, C, 3, device=dev, generator=g).bfloat16()
    ref_pool = pool.clone()
    ref = conv_reference.causal_conv1d_by_slot(x.float(), weight.float(), ref_pool, slots, lens)
    got = torch.cat(conv_triton.causal_conv1d_by_slot(x, weight, pool, slots, lens, splits=(KEY, KEY, VALUE)), 1)
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    state_err = (pool[slots].float() - ref_pool[slots].float()).abs().max().item()
    # the states move on with each call; the times do not depend on their values
    us = bench(lambda: conv_triton.causal_conv1d_by_slot(x, weight, pool, slots, lens, splits=(KEY, KEY, VALUE))) * 1e3
    rate = 2 * x.element_size() * tokens * C / (us * 1e-6) / 1e12
    finite = bool(got.isfinite().all())
    return f"| {tokens} × {seqs} | {us:.1f} | {rate:.2f} | {err:.1e} | {state_err:.0e} | {finite} |"


def state_case(seqs: int, dev: str) -> str:
    pool = torch.randn(LAYERS, seqs + 8, HEADS, DK, DV, device=dev)
    slots = torch.randperm(seqs + 8, device=dev)[:seqs]
    new = torch.randn(seqs, HEADS, DK, DV, device=dev)
    layer = 1
    a = pool.clone()
    a[layer, slots] = new
    b = pool.clone()
    b[layer].index_copy_(0, slots, new)
    same = bool(torch.equal(a, b)) and bool(torch.equal(pool[layer, slots], pool[layer].index_select(0, slots)))
    gather = bench(lambda: pool[layer, slots]) * 1e3
    select = bench(lambda: pool[layer].index_select(0, slots)) * 1e3

    def put() -> None:
        pool[layer, slots] = new

    scatter = bench(put) * 1e3
    index_copy = bench(lambda: pool[layer].index_copy_(0, slots, new)) * 1e3
    floor = 2 * new.numel() * new.element_size() / copy_rate() * 1e6  # read + write
    return f"| {seqs} | {gather:.1f} | {select:.1f} | {scatter:.1f} | {index_copy:.1f} | {floor:.1f} | {same} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8192x1,8192x16,2048x4,512x1,47x32")
    ap.add_argument("--state-seqs", default="1,16,32")
    args = ap.parse_args()
    copy_rate()  # measured before anything takes the GPU's memory (cached for the rooflines)
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("\nconv1d by slot, bf16, 10240 channels (q | k | v 2048 | 2048 | 6144), K = 4", flush=True)
    print("| tokens × sequences | µs | TB/s (x in, out out) | max rel. error | state max abs. error | finite |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    for case in args.cases.split(","):
        tokens, seqs = (int(v) for v in case.split("x"))
        print(conv_case(tokens, seqs, dev), flush=True)
    print("\nrecurrent states fp32 [N, 48, 128, 128], layer 1 of a [2, N + 8, ...] pool; µs per call", flush=True)
    print("| N | pool[l, slots] | index_select | pool[l, slots] = new | index_copy_ | write floor at 4.8 TB/s | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for n in args.state_seqs.split(","):
        print(state_case(int(n), dev), flush=True)


if __name__ == "__main__":
    main()
