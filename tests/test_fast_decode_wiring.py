"""The model through hylora's fast kernels (GDN step in place by slot, paged decode attention, the
fused norms and MLP activation, SDPA prefill attention), run on CPU (Triton's interpreter): the
engine's greedy tokens and logprobs equal the torch reference path, across page boundaries and with
adapters mixed in."""

from __future__ import annotations

import pytest

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

from hylora.engine import SamplingParams  # noqa: E402
from hylora.kernels import FAST_KERNELS, model_kernels  # noqa: E402
from hylora.kernels.select import fast_verdicts  # noqa: E402
from hylora.model.kernels import ModelKernels  # noqa: E402
from tests.engine_helpers import make_engine, run  # noqa: E402
from tests.helpers import random_ids  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the test extra installs it)")


@pytest.mark.parametrize("chunk", [2048, 20], ids=["whole-prompts", "chunked-prefill"])
def test_engine_decode_through_triton_kernels_equals_reference(causal_ckpt, engine_adapter_root, chunk):
    """chunk 20: prompts prefill over several steps, each chunk after a cached prefix (the conv state
    carried in place, attention over earlier pages) with other requests' decode rows in the step;
    every such step is short enough for the token-by-token GDN kernel. Whole prompts: the 80-token
    one sends its step through the chunked delta rule."""
    requests = [
        (f"r{i}", random_ids(n, 320, seed=40 + i), SamplingParams(max_tokens=6, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(13, None), (16, "gdn_attn"), (31, "all_linear"), (47, None), (80, None)])
    ]
    outputs = []
    for fast in (False, True):
        engine = make_engine(
            causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16, max_num_batched_tokens=chunk
        )
        if fast:
            fast_kernels = [
                "gdn_decode",
                "paged_decode_attention",
                "rms_norm",
                "silu_mul",
                "output_gate",
                "prefill_attention",
                "causal_conv1d",
                "gdn_recurrent",
                "save_conv_states",
            ]
            engine.model.use_kernels(model_kernels(fast_verdicts(fast_kernels)))
            assert engine.model.layers[0].linear_attn.decode_step is not None
            assert engine.model.layers[0].linear_attn.short_prefill is not None
            assert engine.model.norm.kernel.__module__ == "hylora.ops.rmsnorm.triton"
            attn = next(layer.self_attn for layer in engine.model.layers if not layer.is_linear)
            assert attn.output_gate.__module__ == "hylora.ops.output_gate.triton"
        outputs.append(run(engine, {0: requests}))
    reference, fast = outputs
    for rid, *_ in requests:
        assert fast[rid].token_ids == reference[rid].token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(fast[rid].logprobs, reference[rid].logprobs, strict=True))
        assert diff <= 1e-4, (rid, diff)


def test_the_default_kernels_are_the_references(causal_ckpt, engine_adapter_root):
    from hylora.ops import paged_attention
    from hylora.ops.causal_conv1d.reference import save_conv_states
    from hylora.ops.output_gate.reference import output_gate
    from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm

    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16)
    model = engine.model
    model.use_kernels(model_kernels(fast_verdicts(list(FAST_KERNELS))))
    model.use_kernels(ModelKernels())
    gdn = next(layer.linear_attn for layer in model.layers if layer.is_linear)
    attn = next(layer.self_attn for layer in model.layers if not layer.is_linear)
    assert gdn.decode_step is None and gdn.short_prefill is None
    assert gdn.save_conv_states is save_conv_states
    assert attn.decode_attention is None and attn.prefill_attention is paged_attention
    assert attn.output_gate is output_gate and attn.output_gate_quantized is None
    assert model.norm.kernel is rms_norm and gdn.norm.kernel is gated_rms_norm
    assert all(getattr(m, "lora_backend", None) is None for m in model.modules())


def test_engine_lora_delta_first_equals_reference(causal_ckpt, engine_adapter_root, monkeypatch):
    """The Triton LoRA with the delta first from 128 tokens: every prompt step here takes it, although
    the steps are shorter than `lora_stacked_below` (the delta first, when asked for, wins). gdn_attn
    targets the GDN and attention projections of layers 0, 2 and 3 only, so alone in a step it leaves
    the MLPs and layer 1 with no slice to apply (on the H200 that failed every such step with an
    IndexError, found by `hylora doctor --lora-delta-first-from 4096`); mixed with rs_mlp, each
    linear applies the slices of one adapter. Tokens and logprobs equal the torch LoRA path."""
    from hylora.kernels.config import KernelsConfig
    from hylora.ops.lora import triton as lora_triton

    calls: list[int] = []
    real = lora_triton.lora_apply_delta_first
    monkeypatch.setattr(
        lora_triton, "lora_apply_delta_first", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k)
    )
    requests = [
        (f"r{i}", random_ids(n, 320, seed=70 + i), SamplingParams(max_tokens=3, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(150, "gdn_attn"), (140, "rs_mlp"), (30, None)])
    ]
    outputs = []
    for delta_first_from in (None, 128):
        engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=256, page_size=16)
        if delta_first_from is not None:
            config = KernelsConfig(lora_backend="triton", lora_delta_first_from=delta_first_from)
            assert config.lora_stacked_below > 150 + 140 + 30  # every step here is below it
            engine.model.use_kernels(model_kernels(fast_verdicts([]), config))
            linears = [m for m in engine.model.modules() if getattr(m, "delta_first_from", 0) == delta_first_from]
            assert linears and all(m.lora_backend == "triton" for m in linears)
        alone = run(engine, {0: requests[:1]})  # gdn_attn alone in its step
        together = run(engine, {0: requests})
        outputs.append({**{f"{rid}-alone": out for rid, out in alone.items()}, **together})
    assert calls and min(calls) >= 128  # the prompt steps took the delta first, no shorter step did
    reference, delta_first = outputs
    for rid, out in reference.items():
        assert delta_first[rid].token_ids == out.token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(delta_first[rid].logprobs, out.logprobs, strict=True))
        assert diff <= 1e-4, (rid, diff)


def test_engine_lora_stacked_in_prefill_steps_equals_reference(causal_ckpt, engine_adapter_root, monkeypatch):
    """`KernelsConfig.lora_stacked_below` above the step: prefill steps of 128 tokens and more take the shrink
    inside the base GEMM (every slot's h rounded to the model dtype, here fp32), as decode steps do,
    with one adapter alone in its step and two mixed. Tokens and logprobs equal the torch LoRA path,
    and the steps of 128 tokens or more did take the stacked GEMM."""
    from hylora.kernels.config import KernelsConfig
    from hylora.model.layers import Linear

    requests = [
        (f"r{i}", random_ids(n, 320, seed=90 + i), SamplingParams(max_tokens=3, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(150, "gdn_attn"), (140, "rs_mlp"), (30, "all_linear")])
    ]
    stacked_tokens: list[int] = []
    real = Linear._stacked
    monkeypatch.setattr(Linear, "_stacked", lambda self, x, v: stacked_tokens.append(v.shape[0]) or real(self, x, v))
    outputs = []
    for stacked_below in (None, 4096):
        engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=256, page_size=16)
        if stacked_below is not None:
            config = KernelsConfig(lora_backend="triton", lora_stacked_below=stacked_below, lora_delta_first_from=0)
            engine.model.use_kernels(model_kernels(fast_verdicts([]), config))
            assert all(m.stacked_below == stacked_below for m in engine.model.modules() if isinstance(m, Linear))
        alone = run(engine, {0: requests[:1]})
        together = run(engine, {0: requests})
        outputs.append({**{f"{rid}-alone": out for rid, out in alone.items()}, **together})
    assert max(stacked_tokens) >= 128  # prefill steps that run 12's decode-size threshold (128) did not stack
    reference, stacked = outputs
    assert_same_outputs(stacked, reference)


def triton_lora(engine, fused_activation: bool = False, **config) -> None:
    """The engine's own kernels (for an FP8 model: the norms and the activation quantising the FP8
    inputs) with hylora's Triton LoRA, and with or without the activation applying gate_up's expand."""
    from hylora.kernels.config import KernelsConfig

    names = ["lora", "silu_mul_lora"] if fused_activation else ["lora"]
    engine.model.use_kernels(model_kernels(dict(engine.kernels) | fast_verdicts(names), KernelsConfig(**config)))


def assert_same_outputs(got: dict, want: dict, tolerance: float = 1e-4) -> None:
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(got[rid].logprobs, out.logprobs, strict=True))
        assert diff <= tolerance, (rid, diff)


def test_fp8_decode_lora_takes_every_slots_h_from_the_fp8_gemm(causal_ckpt, engine_adapter_root, monkeypatch):
    """FP8 projections (quantised at load; the CPU runs the reference FP8 GEMM, fed by the norms and
    the activation that quantise its inputs) with the Triton LoRA: steps under 128 tokens take every
    slot's h from the FP8 GEMM, which serves the 16-bit rows [unquantised rows; A] (the GDN in_proj's
    b / a rows among them) after its own, and run the expand alone, as bf16 decode steps do, with no
    shrink launch. Adapters on different
    projections mixed with base requests: tokens and logprobs equal the torch LoRA path on the same
    FP8 weights."""
    from hylora.kernels.config import KernelsConfig
    from hylora.model.layers import Linear
    from hylora.ops.lora import triton as lora_triton

    requests = [
        (f"r{i}", random_ids(n, 320, seed=90 + i), SamplingParams(max_tokens=5, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(13, None), (16, "gdn_attn"), (31, "all_linear"), (40, "rs_mlp")])
    ]
    expand, expands = lora_triton.lora_expand, []

    def counted_expand(h, *args, **kwargs):
        expands.append(h.ndim)  # 5: [1, T, slices, slots, r], every slot's h; 4: a shrink's partials
        return expand(h, *args, **kwargs)

    outputs = []
    for triton in (False, True):
        engine = make_engine(
            causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16, quantization="fp8",
            kernels=KernelsConfig(fp8_fused_norm_quant=True),
        )  # fmt: skip
        assert engine.kernels["rms_norm_quantized"].implementation == "reference"  # quantised inputs
        fp8 = [m for m in engine.model.modules() if isinstance(m, Linear) and m.is_fp8 and m.lora is not None]
        with_tail = [m for m in fp8 if m.tail_weight is not None]
        assert fp8 and with_tail  # the in_proj's b / a rows stay unquantised
        assert all(m.tail_weight.data_ptr() == m.stacked_weight.data_ptr() for m in with_tail)
        if triton:
            triton_lora(engine)
            monkeypatch.setattr(lora_triton, "lora_shrink", lambda *a, **k: pytest.fail("a shrink launch ran"))
            monkeypatch.setattr(lora_triton, "lora_expand", counted_expand)
        outputs.append(run(engine, {0: requests}))
    assert expands and set(expands) == {5}  # every expand read each token's own slot of the stacked h
    assert_same_outputs(outputs[1], outputs[0])


def as_the_expand_then_the_activation(calls: list):
    """silu_mul_lora, checked on every call against lora_expand then silu_mul (silu_mul_quantized where it
    quantises) on the same inputs; `calls` gets each call's (h.ndim, group). Quantised, the two may round
    an element to neighbouring e4m3 values: their fp32 sums differ in order, by an ulp, and the engine's
    logprobs then by ~1e-2 on the tiny model (an AMD EPYC's BLAS, 2026-12-04), so the check allows that
    for a few elements rather than comparing the engines' logprobs to 1e-4."""
    from hylora.ops.lora.triton import lora_expand
    from hylora.ops.silu_mul import triton as silu_triton

    def fused(gate_up, h, b, meta, group, keep):
        calls.append((h.ndim, group))
        got = silu_triton.silu_mul_lora(gate_up, h, b, meta, group, keep)
        inner = b[0].shape[2]
        expanded = lora_expand(h, b, [(0, inner), (inner, inner)], gate_up.clone(), meta)
        if group is None:
            want = silu_triton.silu_mul(expanded)
            assert (got - want).abs().max().item() <= 1e-5
            return got
        want = silu_triton.silu_mul_quantized(expanded, group, keep)
        assert (got.scale - want.scale).abs().max().item() <= 1e-6 * want.scale.abs().max().item()
        if keep:
            assert (got.x - want.x).abs().max().item() <= 1e-5
        a, c = (v.q.float() * v.scale.repeat_interleave(group, dim=1)[:, :inner] for v in (got, want))
        differ = a != c
        assert differ.float().mean().item() <= 0.01, differ.sum().item()
        assert ((a - c).abs() <= c.abs() / 8 + 1e-6)[differ].all()  # one e4m3 step (3 mantissa bits) at most
        return got

    return fused


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["unquantised", "fp8"])
def test_the_activation_applies_gate_ups_lora_expand_as_the_expand_kernel_does(
    causal_ckpt, engine_adapter_root, quantization
):
    """silu_mul_lora in the engine: a 340-token prompt step (the shrink's fp32 partials; the delta
    first off, the stacked shrink below 128 tokens) and decode steps (every slot's h), adapters that
    target the MLP and one that does not (a zero delta over both slices), base requests beside them;
    with FP8 the activation quantises for the down projection too (fused_lora_expand_quantized), every
    call checked against the expand then the activation on its inputs. Unquantised, the engine's
    tokens and logprobs equal those of the expand kernel then the activation; both forms of h reached
    the fused activation."""
    requests = [
        (f"r{i}", random_ids(n, 320, seed=110 + i), SamplingParams(max_tokens=4, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(150, "gdn_attn"), (140, "rs_mlp"), (30, None), (20, "all_linear")])
    ]
    calls: list = []
    outputs = []
    for fused_activation in (False, True):
        engine = make_engine(
            causal_ckpt[0], engine_adapter_root, max_model_len=256, page_size=16, quantization=quantization
        )
        triton_lora(
            engine, fused_activation, lora_delta_first_from=0, lora_stacked_below=128, fused_lora_expand_quantized=True
        )
        mlps = [layer.mlp for layer in engine.model.layers]
        assert all((m.act_lora is not None) == fused_activation for m in mlps)
        for mlp in mlps if fused_activation else ():
            mlp.act_lora = as_the_expand_then_the_activation(calls)
        outputs.append(run(engine, {0: requests}))
    assert {ndim for ndim, _ in calls} == {4, 5}  # the prompt step's shrink partials, the decode steps' stacked h
    assert {group for _, group in calls} == {None if quantization is None else 128}
    if quantization is None:
        assert_same_outputs(outputs[1], outputs[0])


def test_an_fp8_down_projection_keeps_the_expand_kernel_unless_asked(causal_ckpt, engine_adapter_root):
    """Where the activation quantises for an FP8 down projection, the MLP runs the expand kernel then
    silu_mul_quantized (H200, run 34: the fused quantising variant was the slower one) unless
    KernelsConfig.fused_lora_expand_quantized asks for silu_mul_lora, which then quantises as they do
    (checked on every call)."""
    requests = [
        (f"r{i}", random_ids(n, 320, seed=130 + i), SamplingParams(max_tokens=3, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(40, "rs_mlp"), (20, "all_linear"), (10, None)])
    ]
    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16, quantization="fp8")
    mlps = [layer.mlp for layer in engine.model.layers]
    calls: list = []
    for quantized in (False, True):
        calls.clear()
        triton_lora(engine, True, fused_lora_expand_quantized=quantized)
        assert all(m.act_lora is not None and m.act_quantized is not None for m in mlps)
        for mlp in mlps:
            mlp.act_lora = as_the_expand_then_the_activation(calls)
        outs = run(engine, {0: requests})
        assert all(out.error is None and len(out.token_ids) == 3 for out in outs.values())
        assert bool(calls) == quantized and all(group == 128 for _, group in calls)


def test_the_fused_activation_serves_only_the_triton_lora(causal_ckpt, engine_adapter_root):
    """silu_mul_lora takes over the expand of hylora's Triton LoRA; with another LoRA backend (the
    torch ones have no expand kernel) or fused_lora_expand off the activation stays the plain one."""
    from hylora.kernels.config import KernelsConfig
    from hylora.kernels.select import select_kernels

    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=64, page_size=16)
    mlp = engine.model.layers[0].mlp
    for names, config, fused in (
        (["lora", "silu_mul_lora"], KernelsConfig(), True),
        (["silu_mul_lora"], KernelsConfig(), False),  # the lora kernels failed: the masked / grouped LoRA
        (["lora", "silu_mul_lora"], KernelsConfig(lora_backend="masked"), False),
    ):
        engine.model.use_kernels(model_kernels(fast_verdicts(names), config))
        assert (mlp.act_lora is not None) == fused, (names, config)
    verdicts = select_kernels(engine.model, 16, KernelsConfig(fused_lora_expand=False))
    assert "silu_mul_lora" not in verdicts and mlp.act_lora is None
    assert select_kernels(engine.model, 16)["silu_mul_lora"].implementation == "reference"  # no CUDA here


def test_a_fault_beside_an_adapter_neighbour_stays_in_its_rows_through_the_fused_activation(
    causal_ckpt, engine_adapter_root
):
    """The Triton LoRA with gate_up's expand in the activation: a request whose state turned NaN
    shares its adapter, and so the fused activation's token tiles, with a healthy one; the faulty
    request fails alone and the healthy one's tokens and logprobs are those of a run without the
    fault (bit for bit: same steps, same batch shapes)."""

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, logprobs=1)

    faulty = ("faulty", random_ids(50, 320, seed=1), greedy(8), "all_linear")
    healthy = ("healthy", random_ids(70, 320, seed=2), greedy(8), "all_linear")
    ends_there = ("faulty", faulty[1], greedy(2), "all_linear")

    def engine():
        e = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16, max_num_seqs=2)
        triton_lora(e, fused_activation=True)
        return e

    reference = run(engine(), {0: [ends_there, healthy]})
    e = engine()
    e.add_request(*faulty)
    e.add_request(*healthy)
    e.step()  # both prefilled
    e.inject_fault("faulty")
    out = run(e, {})
    assert out["faulty"].finish_reason == "error" and "numerical fault" in out["faulty"].error
    got, want = out["healthy"], reference["healthy"]
    assert got.token_ids == want.token_ids
    assert [p.logprob for p in got.logprobs] == [p.logprob for p in want.logprobs]
