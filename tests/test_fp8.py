"""FP8 checkpoints (Qwen's -FP8 layout): written by `hylora quantize`, read as transformers reads
them, served with FP8 weights (the reference GEMM on the CPU) with dynamic LoRA on top, merged into an
unquantised model, and refused clearly where hylora cannot serve them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylora.adapters.merge import merge_adapter
from hylora.config import ConfigError, ModelConfig
from hylora.engine import EngineConfig, LLMEngine, SamplingParams
from hylora.kernels import KernelsConfig, select_kernels
from hylora.model.attention import GatedAttention
from hylora.model.fp8 import quantize_checkpoint
from hylora.model.layers import MLP, GatedRMSNorm, Linear, RMSNorm
from hylora.model.loader import CheckpointError, load_model
from hylora.ops.fp8_linear.reference import QuantizedActivation, dequantize_activation, quantize_activation
from tests.conftest import write_causal
from tests.engine_helpers import run
from tests.helpers import hf_logits, hylora_logits, random_ids
from tests.lora_helpers import peft_adapter

# rows and columns straddling the 128 x 128 scale blocks: K = 192 and 160 end inside a block, and the
# fused gate_up (160 + 160 rows) and qkv (256 + 64 + 64) slices end inside one (per-row scales)
UNALIGNED = dict(hidden_size=192, intermediate_size=160)
# every dimension a multiple of 128 or under one block, as in the released checkpoints
ALIGNED = dict(hidden_size=256, intermediate_size=256)


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


@pytest.fixture(scope="module")
def fp8_ckpts(tmp_path_factory):
    """{"unaligned" | "aligned": (bf16-style source dir, its FP8 copy, transformers model of the source)}."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, shape in (("unaligned", UNALIGNED), ("aligned", ALIGNED)):
        src, dst = root / f"{name}-src", root / f"{name}-fp8"
        model = write_causal(src, seed=3, **shape)
        quantize_checkpoint(src, dst, progress=False)
        out[name] = (src, dst, model)
    return out


@pytest.fixture(scope="module")
def fp8_adapter(fp8_ckpts, tmp_path_factory):
    """A PEFT adapter on every projection (FP8 rows and the unquantised in_proj_a/b alike)."""
    path = tmp_path_factory.mktemp("fp8-adapter") / "all"
    peft_adapter(fp8_ckpts["unaligned"][2], path, seed=5, r=8, lora_alpha=16, target_modules="all-linear")
    return path


def test_quantize_writes_the_qwen_fp8_layout(fp8_ckpts):
    _, dst, _ = fp8_ckpts["unaligned"]
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert config["activation_scheme"] == "dynamic" and config["fmt"] == "e4m3"
    # the unquantised projections by full name, as Qwen's releases and vLLM's matcher want them
    assert "model.layers.0.linear_attn.in_proj_a" in config["modules_to_not_convert"]
    tensors = load_file(dst / "model.safetensors")
    gate = tensors["model.layers.0.mlp.gate_proj.weight"]
    assert gate.dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 2)  # 160 x 192 in 128 blocks
    for kept in ("model.layers.0.linear_attn.in_proj_a.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert tensors[kept].dtype != torch.float8_e4m3fn and kept + "_scale_inv" not in tensors
    assert ModelConfig.from_dir(dst).quantization.weight_block_size == (128, 128)


def test_quantize_names_every_tower_linear_it_keeps(vl_media_ckpt, tmp_path):
    """A VL checkpoint's FP8 copy keeps the vision tower in bf16 and names each of its linears in full in
    modules_to_not_convert. vLLM builds the tower with the model's quantisation config and skips a
    layer only when its full name is listed (after mapping `model.visual.` to `visual.`): with the
    short name "visual" alone it made every tower linear FP8 and cast the bf16 weights into it."""
    fp8 = quantize_checkpoint(vl_media_ckpt[0], tmp_path / "fp8", progress=False)
    listed = json.loads((fp8 / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    tensors = load_file(fp8 / "model.safetensors")
    tower = {k.removesuffix(".weight") for k, t in tensors.items() if k.startswith("model.visual.") and t.ndim >= 2}
    linears = {m for m in tower if m.rsplit(".", 1)[-1] in ("qkv", "proj", "linear_fc1", "linear_fc2")}
    assert {m.rsplit(".", 1)[-1] for m in linears} == {"qkv", "proj", "linear_fc1", "linear_fc2"}
    assert any(".merger." in m for m in linears) and any(".patch_embed." in m for m in linears)
    vllm_skips = {name.replace("model.visual.", "visual.", 1) for name in listed}
    for module in linears:
        assert module.replace("model.visual.", "visual.", 1) in vllm_skips, module
        assert tensors[module + ".weight"].dtype != torch.float8_e4m3fn and module + ".weight_scale_inv" not in tensors
    assert not tower - linears - {"model.visual.pos_embed"}, tower - linears  # no tower linear missed
    assert not any(n.startswith(("model.visual.", "visual.")) and n.rsplit(".", 1)[-1] == "norm1" for n in listed)


def test_transformers_reads_the_fp8_checkpoint_as_hylora_does(fp8_ckpts):
    """An independent reader: transformers' FineGrainedFP8 loader, dequantising, gives hylora's logits
    (on block-aligned shapes: it derives the block size from the scale grid)."""
    if torch.cuda.is_available():  # its dequantiser then launches Triton on these CPU tensors and fails
        pytest.skip("a CPU test: transformers' FP8 dequantiser takes Triton on a host with a GPU")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _, dst, _ = fp8_ckpts["aligned"]
    hf = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    ids = random_ids(40, hf.config.vocab_size, 1)
    ours = hylora_logits(load_model(dst, dtype=torch.float32, progress=False), ids)
    assert (logprobs(ours) - logprobs(hf_logits(hf, ids))).abs().max() < 1e-4


def test_fp8_projections_compute_the_checkpoint_values(fp8_ckpts):
    """Every FP8-kept projection (fused slices, per-row scales where slices end inside a block, the
    unquantised tail of the GDN in_proj) equals the dequantised weights on quantised activations for
    its FP8 rows and on the plain activations for its tail."""
    _, dst, _ = fp8_ckpts["unaligned"]
    fp8 = load_model(dst, dtype=torch.float32, progress=False, fp8=True)
    plain = dict(load_model(dst, dtype=torch.float32, progress=False).named_modules())
    layouts = set()
    g = torch.Generator().manual_seed(0)
    for name, linear in fp8.named_modules():
        if not isinstance(linear, Linear) or not linear.is_fp8:
            continue
        layouts.add((linear.quant_block[0], linear.tail_weight is not None))
        x = torch.randn(5, linear.in_features, generator=g)
        q = linear.weight.shape[0]
        w = plain[name].weight
        x_q = dequantize_activation(*quantize_activation(x, 128))
        expected = torch.cat([x_q @ w[:q].T, x @ w[q:].T], dim=-1)
        torch.testing.assert_close(linear.base(x), expected, rtol=1e-5, atol=1e-5)
    # per-block and per-row scales, and a tail: each layout was exercised
    assert {(128, True), (1, False), (128, False)} <= layouts


def test_fp8_weights_serve_close_to_the_dequantised_model(fp8_ckpts):
    _, dst, _ = fp8_ckpts["unaligned"]
    ids = random_ids(48, 320, 2)
    fp8 = logprobs(hylora_logits(load_model(dst, dtype=torch.float32, progress=False, fp8=True), ids))
    plain = logprobs(hylora_logits(load_model(dst, dtype=torch.float32, progress=False), ids))
    assert torch.isfinite(fp8).all()
    # activation quantisation only (the weights are the same values); a scale from the wrong block
    # would move every logit by orders of magnitude
    assert (fp8 - plain).abs().mean() < 0.2


def _prompt_logprobs(engine: LLMEngine, prompt: list[int], adapter: str | None) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = run(engine, {0: [("r", prompt, params, adapter)]})["r"]
    return [p.logprob for p in out.prompt_logprobs if p is not None]


def test_dynamic_lora_on_fp8_matches_the_dequantised_merged_model(fp8_ckpts, fp8_adapter, tmp_path):
    """The oracle of FP8 + LoRA: the dequantised base with the adapter merged. `hylora merge` writes it
    (unquantised; it used to add the delta to raw e4m3 values); dynamic LoRA on the dequantised weights
    equals it exactly, and on the FP8 weights differs only by activation quantisation."""
    _, dst, _ = fp8_ckpts["unaligned"]
    merged_dir = merge_adapter(dst, fp8_adapter, tmp_path / "merged", progress=False)
    assert ModelConfig.from_dir(merged_dir).quantization is None
    assert not any(k.endswith("_scale_inv") for k in load_file(merged_dir / "model.safetensors"))
    prompt = random_ids(70, 320, 3)
    common = dict(device="cpu", dtype="float32", max_lora_rank=8, max_num_seqs=2)
    merged = _prompt_logprobs(LLMEngine(merged_dir, EngineConfig(**common), progress=False), prompt, None)
    lora = {"all": fp8_adapter}
    dequantised = LLMEngine(dst, EngineConfig(quantization="dequantized", **common), lora_modules=lora, progress=False)
    assert dequantised.quantization is None
    exact = _prompt_logprobs(dequantised, prompt, "all")
    assert max(abs(a - b) for a, b in zip(exact, merged, strict=True)) < 1e-4
    fp8 = LLMEngine(dst, EngineConfig(quantization="fp8", **common), lora_modules=lora, progress=False)
    assert fp8.quantization == "fp8"
    served = _prompt_logprobs(fp8, prompt, "all")
    base = _prompt_logprobs(fp8, prompt, None)
    gap = sum(abs(a - b) for a, b in zip(served, merged, strict=True)) / len(merged)
    effect = sum(abs(a - b) for a, b in zip(base, merged, strict=True)) / len(merged)
    assert gap < effect / 3  # the adapter is served, not dropped: its effect dwarfs the FP8 error


def test_weight_only_fp8_serves_the_dequantised_merged_model(fp8_ckpts, fp8_adapter, tmp_path):
    """--fp8-activations none: FP8 weights in memory, activations unquantised. The base model gives the
    dequantised model's logprobs and dynamic LoRA the dequantised merged model's, both to fp32
    summation order (the dynamic path's FP8 error was activation rounding alone)."""
    _, dst, _ = fp8_ckpts["unaligned"]
    merged_dir = merge_adapter(dst, fp8_adapter, tmp_path / "merged", progress=False)
    prompt = random_ids(70, 320, 5)
    common = dict(device="cpu", dtype="float32", max_lora_rank=8, max_num_seqs=2)
    merged = _prompt_logprobs(LLMEngine(merged_dir, EngineConfig(**common), progress=False), prompt, None)
    plain = LLMEngine(dst, EngineConfig(quantization="dequantized", **common), progress=False)
    dequantised = _prompt_logprobs(plain, prompt, None)
    weight_only = LLMEngine(
        dst,
        EngineConfig(quantization="fp8", kernels=KernelsConfig(fp8_activations="none"), **common),
        lora_modules={"all": fp8_adapter},
        progress=False,
    )
    assert weight_only.quantization == "fp8"
    assert any(isinstance(m, Linear) and m.is_fp8 for m in weight_only.model.modules())  # FP8 rows kept
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(weight_only, prompt, None), dequantised, strict=True)) < 1e-4
    served = _prompt_logprobs(weight_only, prompt, "all")
    assert max(abs(a - b) for a, b in zip(served, merged, strict=True)) < 1e-4


def test_split_activation_fp8_serves_the_dequantised_merged_model_within_a_bf16_rounding(
    fp8_ckpts, fp8_adapter, tmp_path
):
    """--fp8-activations split: each projection's input as two e4m3 terms. Base and dynamic LoRA land
    within a bf16 rounding of the activations of the dequantised (merged) model: over 10x closer than
    dynamic FP8, whose activations keep 4 significant bits, and closer than the weight-only engine with
    every projection's input rounded to bf16 first (0.003 against 0.006 and 0.10 here)."""
    _, dst, _ = fp8_ckpts["unaligned"]
    merged_dir = merge_adapter(dst, fp8_adapter, tmp_path / "merged", progress=False)
    prompt = random_ids(70, 320, 5)
    common = dict(device="cpu", dtype="float32", max_lora_rank=8, max_num_seqs=2)
    merged = _prompt_logprobs(LLMEngine(merged_dir, EngineConfig(**common), progress=False), prompt, None)
    lora = {"all": fp8_adapter}

    def gap(activations: str) -> float:
        config = EngineConfig(quantization="fp8", kernels=KernelsConfig(fp8_activations=activations), **common)
        engine = LLMEngine(dst, config, lora_modules=lora, progress=False)
        assert any(isinstance(m, Linear) and m.is_fp8 for m in engine.model.modules())
        served = _prompt_logprobs(engine, prompt, "all")
        return sum(abs(a - b) for a, b in zip(served, merged, strict=True)) / len(merged)

    split, dynamic = gap("split"), gap("dynamic")
    assert split < dynamic / 10, (split, dynamic)
    # the bf16 yardstick: the weight-only engine with every projection's input rounded to bf16
    rounded = LLMEngine(
        dst,
        EngineConfig(quantization="fp8", kernels=KernelsConfig(fp8_activations="none"), **common),
        lora_modules=lora,
        progress=False,
    )
    with pytest.MonkeyPatch.context() as mp:
        from hylora.ops.fp8_linear import reference as fp8_reference

        def rounded_input(x, *args, **kwargs):
            return fp8_reference.fp8_weight_only_linear(x.bfloat16().float(), *args, **kwargs)

        for m in rounded.model.modules():
            if isinstance(m, Linear) and m.is_fp8:
                mp.setattr(m, "fp8_kernel", rounded_input)
        served = _prompt_logprobs(rounded, prompt, "all")
        bf16_gap = sum(abs(a - b) for a, b in zip(served, merged, strict=True)) / len(merged)
    assert split < bf16_gap, (split, bf16_gap)


def test_fp8_checkpoint_without_fp8_hardware_is_dequantised(fp8_ckpts, caplog):
    _, dst, _ = fp8_ckpts["unaligned"]
    auto = LLMEngine(dst, EngineConfig(device="cpu", dtype="float32", max_num_seqs=1), progress=False)
    assert auto.quantization is None and not any(getattr(m, "is_fp8", False) for m in auto.model.modules())
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, kernels=KernelsConfig(fp8_activations="none"))
    with caplog.at_level("WARNING", logger="hylora.engine.engine"):
        LLMEngine(dst, config, progress=False)
    assert "fp8_activations 'none': no effect, no weights are served as FP8" in caplog.text


def test_quantization_fp8_on_an_unquantised_checkpoint_quantises_it_as_the_checkpoint_writer(fp8_ckpts):
    """vLLM's --quantization fp8 on a bf16 checkpoint: hylora quantises at load exactly as
    `hylora quantize` writes the checkpoint."""
    src, dst, _ = fp8_ckpts["unaligned"]
    prompt = random_ids(40, 320, 4)
    common = dict(device="cpu", dtype="float32", max_num_seqs=1, quantization="fp8")
    online = LLMEngine(src, EngineConfig(**common), progress=False)
    assert online.quantization == "fp8"
    written = LLMEngine(dst, EngineConfig(**common), progress=False)
    assert _prompt_logprobs(online, prompt, None) == _prompt_logprobs(written, prompt, None)


def test_fp8_dequantized_gives_the_values_quantisation_at_load_serves(fp8_ckpts):
    """doctor's reference for `--quantization fp8` on an unquantised checkpoint: quantised at load as
    the deployment is, then dequantised; equal to the written FP8 checkpoint loaded dequantised, and
    not to the unquantised weights (whose difference is the weights' FP8 error, not the adapters')."""
    src, dst, _ = fp8_ckpts["unaligned"]
    prompt = random_ids(40, 320, 6)
    common = dict(device="cpu", dtype="float32", max_num_seqs=1)
    round_trip = LLMEngine(src, EngineConfig(quantization="fp8-dequantized", **common), progress=False)
    assert round_trip.quantization is None and round_trip.dequantised_fp8
    written = LLMEngine(dst, EngineConfig(quantization="dequantized", **common), progress=False)
    assert written.dequantised_fp8
    unquantised = LLMEngine(src, EngineConfig(**common), progress=False)
    assert not unquantised.dequantised_fp8
    got = _prompt_logprobs(round_trip, prompt, None)
    assert got == _prompt_logprobs(written, prompt, None)
    assert got != _prompt_logprobs(unquantised, prompt, None)


def test_kernel_floor_reports_the_fp8_gemm(fp8_ckpts):
    _, dst, _ = fp8_ckpts["unaligned"]
    model = load_model(dst, dtype=torch.float32, progress=False, fp8=True)
    verdicts = select_kernels(model, page_size=16)
    assert verdicts["fp8_linear"].implementation == "reference"
    assert "fp8_linear" not in select_kernels(load_model(dst, dtype=torch.float32, progress=False), page_size=16)


@pytest.fixture(scope="module")
def heads128(tmp_path_factory):
    """An FP8 checkpoint whose GDN value heads are 128 wide (one activation group a head, as Qwen's),
    and a PEFT adapter on its every projection."""
    root = tmp_path_factory.mktemp("fp8-heads128")
    model = write_causal(root / "src", seed=4, hidden_size=256, intermediate_size=256, linear_value_head_dim=128)
    quantize_checkpoint(root / "src", root / "fp8", progress=False)
    peft_adapter(model, root / "adapter", seed=6, r=8, lora_alpha=16, target_modules="all-linear")
    return root / "fp8", root / "adapter"


@pytest.mark.parametrize("ckpt", ["unaligned", "heads128"])
def test_the_norms_and_the_mlp_activation_quantise_the_fp8_inputs_and_change_nothing(ckpt, request):
    """The kernel floor gives FP8 layers the norms that quantise the input of the projection behind
    them (rms_norm_quantized: the GDN in_proj or attention qkv, the MLP's gate_up; with 128-wide GDN
    value heads gated_rms_norm_quantized: the out_proj) and the activation that quantises the down
    projection's (silu_mul_quantized): no quantisation launch in those GEMMs (the norms' part by
    fp8_fused_norm_quant, on by default since BASELINE run 35), and the attention's output gate that
    quantises the o_proj's (output_gate_quantized). Base and adapter
    requests in one batch (the adapter's LoRA, and the in_proj's unquantised b / a rows, read the
    kept values): the same logprobs, bit for bit, as the projections quantising their own inputs;
    not with weight-only FP8 (its GEMM takes x as it is)."""
    if ckpt == "unaligned":
        dst, adapter = request.getfixturevalue("fp8_ckpts")["unaligned"][1], request.getfixturevalue("fp8_adapter")
    else:
        dst, adapter = request.getfixturevalue("heads128")
    common = dict(device="cpu", dtype="float32", max_lora_rank=8, max_num_seqs=4, quantization="fp8")
    lora = {"all": adapter}
    fused_config = EngineConfig(**common, kernels=KernelsConfig(fp8_fused_norm_quant=True))
    fused = LLMEngine(dst, fused_config, lora_modules=lora, progress=False)
    unfused_config = EngineConfig(**common, kernels=KernelsConfig(fp8_fused_quant=False))
    unfused = LLMEngine(dst, unfused_config, lora_modules=lora, progress=False)
    for name in ("silu_mul_quantized", "rms_norm_quantized", "output_gate_quantized"):
        assert fused.kernels[name].implementation == "reference" and name not in unfused.kernels
    act_calls, norm_calls, gate_calls = [], [], []
    for mlp in (m for m in fused.model.modules() if isinstance(m, MLP)):
        act = mlp.act_quantized
        mlp.act_quantized = lambda h, group, keep, act=act: act_calls.append(keep) or act(h, group, keep)
    layers = list(fused.model.layers)
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if ckpt == "heads128":  # the GDN output norms quantise for the out_proj too
        norms += [layer.linear_attn.norm for layer in layers if layer.is_linear]
    for norm in norms:
        kernel = norm.kernel_quantized
        norm.kernel_quantized = lambda *a, kernel=kernel, norm=norm: norm_calls.append(norm) or kernel(*a)
    attentions = [layer.self_attn for layer in layers if not layer.is_linear]
    for attn in attentions:
        gate = attn.output_gate_quantized
        attn.output_gate_quantized = lambda o, g, group, keep, gate=gate: (
            gate_calls.append(keep) or gate(o, g, group, keep)
        )
    assert attentions and all(
        a.output_gate_quantized is None for a in unfused.model.modules() if isinstance(a, GatedAttention)
    )
    assert all(m.act_quantized is None for m in unfused.model.modules() if isinstance(m, MLP))
    assert all(m.kernel_quantized is None for m in unfused.model.modules() if isinstance(m, RMSNorm | GatedRMSNorm))
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0, logprobs=0)
    prompts = {"base": (random_ids(70, 320, 4), None), "lora": (random_ids(70, 320, 5), "all")}
    results = []
    for engine in (fused, unfused):
        out = run(engine, {0: [(name, ids, params, adapter) for name, (ids, adapter) in prompts.items()]})
        results.append({k: ([p.logprob for p in o.prompt_logprobs if p], o.token_ids) for k, o in out.items()})
    assert results[0] == results[1]
    assert True in act_calls and False not in act_calls  # one mixed batch: LoRA kept the values at every step
    assert True in gate_calls and False not in gate_calls
    assert {id(n) for n in norm_calls} == {id(n) for n in norms}
    unquantised = KernelsConfig(fp8_activations="none", fp8_fused_norm_quant=True)  # the GEMM takes x as it is
    kernels = LLMEngine(dst, EngineConfig(**common, kernels=unquantised), progress=False).kernels
    assert not {"silu_mul_quantized", "rms_norm_quantized", "output_gate_quantized"} & set(kernels)
    # by default both quantise for their GEMMs (run 35: the fused norms the faster); asked not to, the
    # norms leave it to the GEMM
    kernels = LLMEngine(dst, EngineConfig(**common), progress=False).kernels
    assert "silu_mul_quantized" in kernels and "rms_norm_quantized" in kernels
    no_norms = EngineConfig(**common, kernels=KernelsConfig(fp8_fused_norm_quant=False))
    kernels = LLMEngine(dst, no_norms, progress=False).kernels
    assert "silu_mul_quantized" in kernels and "rms_norm_quantized" not in kernels


@pytest.mark.parametrize("ckpt", ["unaligned", "heads128"])
def test_split_activations_are_split_by_their_producers_and_change_nothing(ckpt, request):
    """--fp8-activations split: the norms, the MLP activation and the attention's output gate write each
    FP8 projection's input as its two e4m3 terms in their own launch (as they quantise it for dynamic
    activations), and every split GEMM they feed reads both. Base and adapter requests in one batch: the
    same logprobs, bit for bit, as the GEMMs splitting their inputs themselves (fp8_fused_quant off)."""
    if ckpt == "unaligned":
        dst, adapter = request.getfixturevalue("fp8_ckpts")["unaligned"][1], request.getfixturevalue("fp8_adapter")
    else:
        dst, adapter = request.getfixturevalue("heads128")
    common = dict(device="cpu", dtype="float32", max_lora_rank=8, max_num_seqs=4, quantization="fp8")
    engines = {
        fused: LLMEngine(
            dst,
            EngineConfig(**common, kernels=KernelsConfig(fp8_activations="split", fp8_fused_quant=fused)),
            lora_modules={"all": adapter},
            progress=False,
        )
        for fused in (True, False)
    }
    assert {"silu_mul_quantized", "rms_norm_quantized", "output_gate_quantized"} <= set(engines[True].kernels)
    inputs, o_proj_inputs = [], []  # (fused engine) what reached each FP8 GEMM: a split input, or x itself
    for name, linear in engines[True].model.named_modules():
        if isinstance(linear, Linear) and linear.is_fp8:
            gemm, seen = linear.fp8_kernel, o_proj_inputs if name.endswith("o_proj") else inputs
            linear.fp8_kernel = lambda x, *a, gemm=gemm, seen=seen, **k: seen.append(x) or gemm(x, *a, **k)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0, logprobs=0)
    prompts = {"base": (random_ids(70, 320, 6), None), "lora": (random_ids(70, 320, 7), "all")}
    results = []
    for engine in engines.values():
        out = run(engine, {0: [(name, ids, params, adapter) for name, (ids, adapter) in prompts.items()]})
        results.append({k: ([p.logprob for p in o.prompt_logprobs if p], o.token_ids) for k, o in out.items()})
    assert results[0] == results[1]
    split = [x for x in inputs if isinstance(x, QuantizedActivation)]
    assert split and all(x.lo is not None for x in split)
    # most GEMMs behind a norm or the activation took their input split, every o_proj did
    assert len(split) > len(inputs) // 2
    assert o_proj_inputs and all(isinstance(x, QuantizedActivation) and x.lo is not None for x in o_proj_inputs)


def _copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            (dst / item.name).write_bytes(item.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors, dst)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_broken_fp8_checkpoints_are_refused_with_the_tensor_named(fp8_ckpts, tmp_path):
    _, dst, _ = fp8_ckpts["unaligned"]
    key = "model.layers.0.mlp.down_proj.weight_scale_inv"

    def wrong_scale(tensors, _):
        tensors[key] = tensors[key][:, :1].contiguous()

    with pytest.raises(CheckpointError, match="down_proj.weight_scale_inv"):
        load_model(_copy_with(dst, tmp_path / "scale", wrong_scale), progress=False)

    def nan_scale(tensors, _):
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = float("nan")

    with pytest.raises(CheckpointError, match="down_proj.weight_scale_inv.*non-finite"):
        load_model(_copy_with(dst, tmp_path / "nan", nan_scale), progress=False)

    def no_config(_, path):
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))

    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_model(_copy_with(dst, tmp_path / "noconfig", no_config), progress=False)

    def other_method(_, path):
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ConfigError, match="'awq' is not supported"):
        load_model(_copy_with(dst, tmp_path / "awq", other_method), progress=False)


@pytest.fixture(scope="module")
def fp8_demo(demo_dir, tmp_path_factory):
    return quantize_checkpoint(demo_dir, tmp_path_factory.mktemp("demo-fp8") / "demo-fp8", progress=False)


def _doctor(model_dir: Path, adapters: Path, monkeypatch, broken_kernel=None, flags: tuple[str, ...] = ()) -> dict:
    import contextlib
    import io
    from dataclasses import replace

    import hylora.kernels.select as select
    from hylora.cli import build_parser
    from hylora.doctor.cli import run_from_args

    if broken_kernel is not None:
        chosen = select.model_kernels
        monkeypatch.setattr(select, "model_kernels", lambda *a: replace(chosen(*a), fp8_linear=broken_kernel))
    out = model_dir.parent / "doctor.json"
    argv = ["doctor", str(model_dir), "--lora-modules", f"relic={adapters / 'relic'}", "--device", "cpu"]
    argv += ["--quantization", "fp8", "--max-model-len", "300", "--json", str(out), *flags]
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_from_args(build_parser().parse_args(argv))
    report = json.loads(out.read_text())
    checks = {c["name"]: c["status"] for c in report["checks"]}
    fp8 = next(c for c in report["checks"] if c["name"] == "fp8")
    return {"exit": code, "checks": checks, "fp8": fp8, "features": report["features"]}


def test_doctor_checks_fp8_serving_against_the_dequantised_checkpoint(fp8_demo, demo_dir, monkeypatch):
    """In-process doctor on the FP8 demo served with FP8 weights: the reference is a second engine on
    the dequantised weights; fidelity and the fp8 check pass. An FP8 GEMM that applies wrong scales
    (each block its neighbour's along K, 4x) fails the fp8 check."""
    from hylora.ops.fp8_linear.reference import fp8_linear

    good = _doctor(fp8_demo, demo_dir / "adapters", monkeypatch)
    assert good["exit"] == 0 and good["checks"]["fp8"] == "pass" and good["checks"]["fidelity"] == "pass"

    def shifted_scales(x, w, scale, block, out=None, extra=None):
        return fp8_linear(x, w, scale.roll(1, dims=1) * 4, block, out=out, extra=extra)

    bad = _doctor(fp8_demo, demo_dir / "adapters", monkeypatch, broken_kernel=shifted_scales)
    assert bad["exit"] == 1 and bad["checks"]["fp8"] == "fail"


@pytest.mark.parametrize("activations", ["none", "split"])
def test_doctor_holds_weight_only_fp8_to_the_unquantised_tolerance(activations, fp8_demo, demo_dir, monkeypatch):
    """`--fp8-activations none` (weight-only, as hylora serve): the FP8 weights' only error against the
    dequantised reference is summation order, so the fp8 check judges with the tolerance an unquantised
    deployment gets, far below FP8's, and passes; so does `split` (the activations within a bf16 rounding:
    bf16's tolerance at least).
    A deployment that quantises the activations anyway under that flag (the dynamic GEMM installed)
    passes FP8's tolerance but fails this one."""
    from hylora.doctor.compare import PRESETS
    from hylora.doctor.fastpaths import FP8_TOLERANCE
    from hylora.ops.fp8_linear.reference import fp8_linear

    flags = ("--fp8-activations", activations)
    good = _doctor(fp8_demo, demo_dir / "adapters", monkeypatch, flags=flags)
    assert good["exit"] == 0 and good["checks"]["fp8"] == "pass" and good["checks"]["fidelity"] == "pass"
    assert good["features"]["quantized_activations"] is False
    assert "unquantised or split activations" in good["fp8"]["summary"]
    if activations == "none":
        assert good["fp8"]["data"]["tolerance"]["mean"] < FP8_TOLERANCE.mean / 10
    else:  # on this fp32 model: held to bf16's tolerance (a bf16 rounding's precision), far above its error
        assert good["fp8"]["data"]["tolerance"]["mean"] == PRESETS["bfloat16"].mean < FP8_TOLERANCE.mean
        error = float(good["fp8"]["summary"].split("mean ")[1].split(" ")[0])
        assert error < FP8_TOLERANCE.mean / 20

    bad = _doctor(fp8_demo, demo_dir / "adapters", monkeypatch, broken_kernel=fp8_linear, flags=flags)
    assert bad["exit"] == 1 and bad["checks"]["fp8"] == "fail"


def test_quantised_tower_weights_and_scales_in_another_shard_load(vl_media_ckpt, tmp_path):
    """A checkpoint that also quantises the vision tower's linears, with every scale in a shard of
    its own (as a sharded release may place them): the tower loads dequantised (with vision=True, and
    is skipped without it), each scale read from its own shard."""
    from hylora.ops.fp8_linear.reference import dequantize_weight, quantize_weight

    fp8 = quantize_checkpoint(vl_media_ckpt[0], tmp_path / "fp8", progress=False)
    tensors = load_file(fp8 / "model.safetensors")
    tower = [k for k, t in tensors.items() if k.startswith("model.visual.blocks.") and t.ndim == 2]
    tower = [k for k in tower if k.endswith(".weight")]
    assert tower
    for key in tower:
        tensors[key], tensors[key + "_scale_inv"] = quantize_weight(tensors[key].float())
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    weights = {k: v for k, v in tensors.items() if k not in scales}
    (fp8 / "model.safetensors").unlink()
    save_file(weights, fp8 / "model-00001-of-00002.safetensors")
    save_file(scales, fp8 / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in weights}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in scales}
    (fp8 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    model = load_model(fp8, dtype=torch.float32, progress=False, vision=True, fp8=True)
    params = dict(model.named_parameters())
    for key in tower:
        expected = dequantize_weight(tensors[key], tensors[key + "_scale_inv"])
        assert torch.equal(params[key.removeprefix("model.")], expected), key
    assert any(m.is_fp8 for m in model.modules() if isinstance(m, Linear))
    text_only = load_model(fp8, dtype=torch.float32, progress=False, fp8=True)
    assert text_only.visual is None


def test_fp8_slices_that_do_not_lead_a_fused_projection_are_dequantised(fp8_ckpts, tmp_path):
    """in_proj_a quantised but in_proj_b (fused between z and a) not: no FP8 GEMM can cover those rows,
    so the GDN in_proj loads dequantised, with the values its checkpoint tensors stand for."""
    from hylora.ops.fp8_linear.reference import quantize_weight

    _, dst, _ = fp8_ckpts["unaligned"]

    def quantise_a(tensors, _):
        key = "model.layers.0.linear_attn.in_proj_a.weight"
        tensors[key], tensors[key + "_scale_inv"] = quantize_weight(tensors[key].float())

    odd = _copy_with(dst, tmp_path / "odd", quantise_a)
    fp8 = load_model(odd, dtype=torch.float32, progress=False, fp8=True)
    plain = load_model(odd, dtype=torch.float32, progress=False)
    assert not fp8.layers[0].linear_attn.in_proj.is_fp8 and fp8.layers[1].linear_attn.in_proj.is_fp8
    assert torch.equal(fp8.layers[0].linear_attn.in_proj.weight, plain.layers[0].linear_attn.in_proj.weight)
