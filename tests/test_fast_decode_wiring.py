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
                "prefill_attention",
                "causal_conv1d",
                "gdn_recurrent",
                "save_conv_states",
            ]
            engine.model.use_kernels(model_kernels(fast_verdicts(fast_kernels)))
            assert engine.model.layers[0].linear_attn.decode_step is not None
            assert engine.model.layers[0].linear_attn.short_prefill is not None
            assert engine.model.norm.kernel.__module__ == "hylora.ops.rmsnorm.triton"
        outputs.append(run(engine, {0: requests}))
    reference, fast = outputs
    for rid, *_ in requests:
        assert fast[rid].token_ids == reference[rid].token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(fast[rid].logprobs, reference[rid].logprobs, strict=True))
        assert diff <= 1e-4, (rid, diff)


def test_the_default_kernels_are_the_references(causal_ckpt, engine_adapter_root):
    from hylora.ops import paged_attention
    from hylora.ops.causal_conv1d.reference import save_conv_states
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
    assert model.norm.kernel is rms_norm and gdn.norm.kernel is gated_rms_norm
    assert all(getattr(m, "lora_backend", None) is None for m in model.modules())


def test_engine_lora_delta_first_equals_reference(causal_ckpt, engine_adapter_root):
    """The Triton LoRA with the delta first from 128 tokens (shorter steps shrink inside the base
    GEMM): every prompt step here takes it. gdn_attn
    targets the GDN and attention projections of layers 0, 2 and 3 only, so alone in a step it leaves
    the MLPs and layer 1 with no slice to apply (on the H200 that failed every such step with an
    IndexError, found by `hylora doctor --lora-delta-first-from 4096`); mixed with rs_mlp, each
    linear applies the slices of one adapter. Tokens and logprobs equal the torch LoRA path."""
    from hylora.kernels.config import KernelsConfig
    from hylora.model.layers import STACKED_LORA_BELOW

    requests = [
        (f"r{i}", random_ids(n, 320, seed=70 + i), SamplingParams(max_tokens=3, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(150, "gdn_attn"), (140, "rs_mlp"), (30, None)])
    ]
    outputs = []
    for delta_first_from in (None, STACKED_LORA_BELOW):
        engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=256, page_size=16)
        if delta_first_from is not None:
            config = KernelsConfig(lora_backend="triton", lora_delta_first_from=delta_first_from)
            engine.model.use_kernels(model_kernels(fast_verdicts([]), config))
            linears = [m for m in engine.model.modules() if getattr(m, "delta_first_from", 0) == delta_first_from]
            assert linears and all(m.lora_backend == "triton" for m in linears)
        alone = run(engine, {0: requests[:1]})  # gdn_attn alone in its step
        together = run(engine, {0: requests})
        outputs.append({**{f"{rid}-alone": out for rid, out in alone.items()}, **together})
    reference, delta_first = outputs
    for rid, out in reference.items():
        assert delta_first[rid].token_ids == out.token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(delta_first[rid].logprobs, out.logprobs, strict=True))
        assert diff <= 1e-4, (rid, diff)
