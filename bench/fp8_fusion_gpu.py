"""The two FP8 glue changes of 2026-12-03 against the paths they replace, in one process (GPU):

1. the MLP activation quantising the FP8 down projection's input (`silu_mul_quantized`, one launch)
   against `silu_mul` then `quantize_activation` (two launches, the [T, I] activation written and read
   back), at the 27B's intermediate size 17408;
2. cuBLAS writing the GDN in_proj's FP8 rows (16384 x 5120) into their column slice of the
   [T, 16384 + 96] output (`out=`) against writing a [T, 16384] result and copying it in;
3. the residual add + RMSNorm quantising the next projection's input (`rms_norm_quantized`, one
   launch, the norm kept as the in_proj's b / a rows need it) against `rms_norm` then
   `quantize_activation`, at the hidden size 5120.

Each: the kernel floor's check of the new path first (error vs the reference; the FP8 GEMM's check
includes the sliced out), then the median GPU time of one call (20 calls in a CUDA graph), old / new.
--engine: then two FP8 engines on the same random 27B-shape model cut to --layers layers, one with
every change and one with none, score the same prompts (base and an adapter, one batch; prefill
steps of 2048 tokens and a last one that is not a multiple of 16): their prompt logprobs and greedy
tokens, compared.

--split: the same producers splitting for `--fp8-activations split` (both e4m3 terms in the producer's
launch) against the plain op then `quantize_activation_split`, at decode sizes; checks first.

--output-gate: the attention's output gate o * sigmoid(gate) (the 27B's 24 heads of 256, the gate a
view of the qkv output) in one launch (`ops.output_gate`) against the torch ops the layer ran before
(the gate's copy, the sigmoid, the product), in bf16 and quantising for an FP8 o_proj (one term, two)
against those ops then `quantize_activation` (`_split`).

    python bench/fp8_fusion_gpu.py [--tokens 32,2048,8192] [--engine --layers 4]
    python bench/fp8_fusion_gpu.py --split [--tokens 1,8,32,256]
    python bench/fp8_fusion_gpu.py --output-gate [--tokens 1,8,32,256,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep_gpu import bench  # noqa: E402
from hylora.kernels import KernelsConfig, checks  # noqa: E402
from hylora.ops.fp8_linear import cublas, reference  # noqa: E402
from hylora.ops.fp8_linear import triton as fp8_triton  # noqa: E402
from hylora.ops.output_gate import triton as gates  # noqa: E402
from hylora.ops.rmsnorm import triton as norm  # noqa: E402
from hylora.ops.silu_mul import triton as silu  # noqa: E402

INTERMEDIATE, HIDDEN, IN_PROJ_FP8, IN_PROJ_TAIL = 17408, 5120, 16384, 96


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,2048,8192")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--split", action="store_true", help="the producers splitting for split activations")
    ap.add_argument("--output-gate", action="store_true", help="the attention's output gate, fused and not")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dev, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.output_gate:
        default = args.tokens == ap.get_default("tokens")
        return output_gate(tokens if not default else [1, 8, 32, 256, 2048, 8192], dev, dtype)
    if args.split:
        return split_producers(tokens if args.tokens != ap.get_default("tokens") else [1, 8, 32, 256], dev, dtype)
    err = checks.silu_mul_error(INTERMEDIATE, dtype, dev, quantized=True)
    print(f"check silu_mul_quantized: max rel. error {err:.2e}", flush=True)
    err = checks.rms_norm_quantized_error(HIDDEN, 1e-6, dtype, dev)
    print(f"check rms_norm_quantized: max rel. error {err:.2e}", flush=True)
    err = checks.fp8_linear_error(IN_PROJ_FP8, HIDDEN, (128, 128), dtype, dev, kernel=cublas.fp8_linear)
    print(f"check cublas fp8_linear (sliced out, pre-quantised input): max rel. error {err:.2e}", flush=True)

    w, w_scale = reference.quantize_weight(torch.randn(IN_PROJ_FP8, HIDDEN, device=dev))
    print(
        "\n| tokens | silu_mul + quantize µs | silu_mul_quantized µs | in_proj: result + copy µs | out= µs "
        "| rms_norm + quantize µs | rms_norm_quantized (kept) µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    nw = torch.randn(HIDDEN, device=dev, dtype=dtype) * 0.1
    for T in tokens:
        gate_up = torch.randn(T, 2 * INTERMEDIATE, device=dev, dtype=dtype)
        unfused = bench(lambda g=gate_up: fp8_triton.quantize_activation(silu.silu_mul(g)))
        fused = bench(lambda g=gate_up: silu.silu_mul_quantized(g))
        x = torch.randn(T, HIDDEN, device=dev, dtype=dtype)
        y = torch.empty(T, IN_PROJ_FP8 + IN_PROJ_TAIL, device=dev, dtype=dtype)
        view = y[:, :IN_PROJ_FP8]

        def copy(x=x, view=view):
            view.copy_(cublas.fp8_linear(x, w, w_scale))

        def into(x=x, view=view):
            cublas.fp8_linear(x, w, w_scale, out=view)

        copied, direct = bench(copy), bench(into)
        res = torch.randn_like(x)
        norm_unfused = bench(lambda x=x, r=res: fp8_triton.quantize_activation(norm.rms_norm(x, nw, 1e-6, r)[0]))
        norm_fused = bench(lambda x=x, r=res: norm.rms_norm_quantized(x, nw, 1e-6, r, keep=True))
        row = (T, *(1e3 * t for t in (unfused, fused, copied, direct, norm_unfused, norm_fused)))
        print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(*row), flush=True)
    print(f"\ncuBLAS took out= : {not cublas._WRITES_INTO}")
    if args.engine:
        compare_engines(args.layers)


def split_producers(tokens: list[int], dev: str, dtype: torch.dtype) -> None:
    """The norms and the activation writing both e4m3 terms in their launch, against the plain op then
    quantize_activation_split (µs, median of one call in a CUDA graph)."""
    hv, dv = 48, 128  # the 27B's GDN value heads
    for name, err in (
        ("silu_mul_quantized", checks.silu_mul_error(INTERMEDIATE, dtype, dev, quantized=True, split=True)),
        ("rms_norm_quantized", checks.rms_norm_quantized_error(HIDDEN, 1e-6, dtype, dev, heads=(hv, dv), split=True)),
    ):
        print(f"check {name} (split): max rel. error {err:.2e}", flush=True)
    split = fp8_triton.quantize_activation_split
    print(
        "\n| tokens | silu_mul + split µs | silu_mul_quantized(split) µs | rms_norm + split µs "
        "| rms_norm_quantized(split, kept) µs | gated norm + split µs | gated_rms_norm_quantized(split) µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    nw, gw = torch.randn(HIDDEN, device=dev, dtype=dtype) * 0.1, torch.randn(dv, device=dev, dtype=dtype) + 1
    for T in tokens:
        gate_up = torch.randn(T, 2 * INTERMEDIATE, device=dev, dtype=dtype)
        x, res = torch.randn(T, HIDDEN, device=dev, dtype=dtype), torch.randn(T, HIDDEN, device=dev, dtype=dtype)
        o, z = (torch.randn(T, hv, dv, device=dev, dtype=dtype) for _ in range(2))
        times = (
            bench(lambda g=gate_up: split(silu.silu_mul(g))),
            bench(lambda g=gate_up: silu.silu_mul_quantized(g, split=True)),
            bench(lambda x=x, r=res: split(norm.rms_norm(x, nw, 1e-6, r)[0])),
            bench(lambda x=x, r=res: norm.rms_norm_quantized(x, nw, 1e-6, r, keep=True, split=True)),
            bench(lambda o=o, z=z, T=T: split(norm.gated_rms_norm(o, z, gw, 1e-6).reshape(T, hv * dv))),
            bench(lambda o=o, z=z: norm.gated_rms_norm_quantized(o, z, gw, 1e-6, split=True)),
        )
        print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(T, *(1e3 * t for t in times)))


def output_gate(tokens: list[int], dev: str, dtype: torch.dtype) -> None:
    """The output gate in one launch against the layer's former torch ops (µs, median of one call in a
    CUDA graph), plain and quantising for an FP8 o_proj; the start-up checks first."""
    heads, head_dim, kv_heads = 24, 256, 4  # the 27B's attention
    for name, quantized, split in (("plain", False, False), ("dynamic", True, False), ("split", True, True)):
        err = checks.output_gate_error(heads, head_dim, kv_heads, dtype, dev, quantized=quantized, split=split)
        print(f"check output_gate ({name}): max rel. error {err:.2e}", flush=True)
    print(
        "\n| tokens | torch ops µs | output_gate µs | torch ops + quantize µs | output_gate_quantized µs "
        "| torch ops + split µs | output_gate_quantized(split) µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    split = fp8_triton.quantize_activation_split
    for T in tokens:
        qkv = torch.randn(T, heads * head_dim * 2 + 2 * kv_heads * head_dim, device=dev, dtype=dtype)
        gate = qkv[:, : heads * head_dim * 2].reshape(T, heads, 2 * head_dim).chunk(2, dim=-1)[1]
        o = torch.randn(T, heads, head_dim, device=dev, dtype=dtype)

        def torch_ops(o=o, gate=gate, T=T):
            return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))

        times = (
            bench(torch_ops),
            bench(lambda o=o, g=gate: gates.output_gate(o, g)),
            bench(lambda: fp8_triton.quantize_activation(torch_ops())),  # noqa: B023
            bench(lambda o=o, g=gate: gates.output_gate_quantized(o, g)),
            bench(lambda: split(torch_ops())),  # noqa: B023
            bench(lambda o=o, g=gate: gates.output_gate_quantized(o, g, split=True)),
        )
        print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(T, *(1e3 * t for t in times)))


def compare_engines(layers: int, prompt_len: int = 3000) -> None:
    import tempfile

    from bench.engine_gpu import QWEN36_27B, random_adapters, random_model
    from hylora.config import ModelConfig
    from hylora.demo import write_tokenizer
    from hylora.engine import EngineConfig, LLMEngine, SamplingParams
    from hylora.model.fp8 import quantize_linears

    cfg = ModelConfig.from_hf(dict(QWEN36_27B, num_hidden_layers=layers))
    work = Path(tempfile.mkdtemp())
    (work / "tok").mkdir()
    write_tokenizer(work / "tok", 1024)
    adapters = random_adapters(work, cfg, n=1)
    g = torch.Generator().manual_seed(0)
    prompts = {name: torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for name in ("base", "a0")}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = []
    for fused in (True, False):
        cublas._WRITES_INTO[:] = [] if fused else [False]  # [False]: the result + copy path
        model = random_model(cfg, "cuda", torch.bfloat16)
        quantize_linears(model)
        # fused_lora_expand off in both: without the quantisation fusions the MLP would take gate_up's
        # LoRA through silu_mul_lora, whose h . B sums differ from the expand kernel's on a GPU (run 35)
        config = EngineConfig(
            max_model_len=4096, max_num_seqs=2, max_num_batched_tokens=2048, max_loras=1, max_lora_rank=16,
            enable_prefix_caching=False,
            kernels=KernelsConfig(fp8_fused_quant=fused, fp8_fused_norm_quant=fused, fused_lora_expand=False),
            num_pages=2 * (4096 // EngineConfig.page_size + 1),  # both engines fit
        )  # fmt: skip
        engine = LLMEngine(work / "tok", config, adapters, progress=False, model=model)
        for name, ids in prompts.items():
            engine.add_request(name, ids, params, None if name == "base" else name)
        outs = {}
        while engine.has_unfinished():
            outs |= {o.request_id: o for o in engine.step() if o.finished}
        results.append(
            {k: (torch.tensor([p.logprob for p in o.prompt_logprobs[1:]]), o.token_ids) for k, o in outs.items()}
        )
        print(f"engine {'with' if fused else 'without'} the changes: {engine.kernels['fp8_linear']}", flush=True)
        del engine, model
        torch.cuda.empty_cache()
    for name in prompts:
        (new, new_ids), (old, old_ids) = results[0][name], results[1][name]
        d = (new - old).abs()
        print(f"{name}: {prompt_len} prompt logprobs max |Δ| {d.max():.3g}, mean {d.mean():.3g}, finite "
              f"{bool(torch.isfinite(new).all())}; greedy tokens equal {new_ids == old_ids}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
