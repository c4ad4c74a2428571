"""The start-up checks of the fast kernels accept a kernel equal to the reference and reject wrong,
NaN, lazy (output left unwritten) and trespassing (foreign memory written) ones. Torch stand-ins
play the kernels, so this runs without Triton."""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch

from hylora.kernels import checks as check
from hylora.kernels import select
from hylora.ops.gdn_decode.reference import gdn_decode
from hylora.ops.lora import reference as lora_reference
from hylora.ops.paged_decode_attention.reference import paged_decode_attention
from hylora.ops.rotary.reference import rotate_half
from tests.conftest import text_config

GDN = (2, 4, 8, 8, 4, torch.float32, "cpu")  # hk, hv, dk, dv, conv kernel, dtype, device
ATTN = (4, 2, 16, 4, torch.float32, "cpu")  # heads, kv heads, head_dim, page size
LORA = (32, [24, 8], 8, torch.float32, "cpu")  # in_features, slice rows, rank


def gdn_error(kernel) -> float:
    return check.gdn_decode_error(*GDN, batches=(1, 3, 8), kernel=kernel)


def attention_error(kernel) -> float:
    return check.paged_decode_attention_error(*ATTN, batches=(1, 3, 8), lengths=(1, 5, 17, 40), kernel=kernel)


def test_gdn_check():
    assert gdn_error(gdn_decode) == 0.0

    def leaves_a_row_unwritten(*args, out, **kw):
        o = gdn_decode(*args, **kw)
        out.copy_(o)
        out[0, 0, 0] = float("nan")
        return out

    def writes_a_foreign_slot(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out):
        gdn_decode(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out=out)
        recurrent[torch.isnan(recurrent[:, 0, 0, 0])] = 0.0  # scrubs slots it does not own
        return out

    def swapped_value_heads(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out):
        return gdn_decode(qkv, b.flip(1), a.flip(1), w, A_log, dt_bias, conv, recurrent, slots, out=out)

    def new_buffer(*args, out, **kw):
        return gdn_decode(*args, **kw)

    assert gdn_error(leaves_a_row_unwritten) == check.FAILED
    assert gdn_error(writes_a_foreign_slot) == check.FAILED
    assert gdn_error(new_buffer) == check.FAILED
    assert gdn_error(swapped_value_heads) > 0.05


def test_attention_check():
    assert attention_error(paged_decode_attention) == 0.0

    def nan_padding_row(q, k, v, table, lens, page_size, scale, out):
        paged_decode_attention(q, k, v, table, lens, page_size, scale, out=out)
        out[lens == 0] = float("nan")
        return out

    def reads_past_the_length(q, k, v, table, lens, page_size, scale, out):
        return paged_decode_attention(q, k, v, table, lens + 1, page_size, scale, out=out)

    def wrong_scale(q, k, v, table, lens, page_size, scale, out):
        return paged_decode_attention(q, k, v, table, lens, page_size, 2 * scale, out=out)

    assert attention_error(nan_padding_row) == check.FAILED
    assert attention_error(reads_past_the_length) == check.FAILED  # NaN page
    assert attention_error(wrong_scale) > 0.05


def test_lora_check():
    tokens = (1, 64, 65, 129)

    def reference_all(x, y, stack, batch):
        return lora_reference.lora_apply(x, y, stack.a, stack.b, stack.offsets, batch.token_slots)

    assert check.lora_error(*LORA, tokens=tokens, kernel=reference_all) < 1e-6

    def touches_base_rows(x, y, stack, batch):
        reference_all(x, y, stack, batch)
        y[batch.token_slots < 0] = 0.0
        return y

    def drops_slot_1(x, y, stack, batch):
        slots = batch.token_slots.clone()
        slots[slots == 1] = -1
        h = lora_reference.lora_shrink(x, stack.a, slots)
        return lora_reference.lora_expand(h, stack.b, stack.offsets, slots, y)

    assert check.lora_error(*LORA, tokens=tokens, kernel=touches_base_rows) == check.FAILED
    assert check.lora_error(*LORA, tokens=tokens, kernel=drops_slot_1) > 0.05


def test_tower_rotary_check():
    def error(kernel) -> float:
        return check.tower_rotary_error(2, 12, torch.float32, "cpu", tokens=(1, 3, 20), kernel=kernel)

    assert error(rotate_half) == 0.0

    def leaves_an_element_unwritten(x, cos, sin, out=None):
        rotate_half(x, cos, sin, out=out)
        out[-1, -1, -1] = float("nan")
        return out

    def writes_the_v_heads(x, cos, sin, out=None):
        rotate_half(x, cos, sin, out=out)
        if out.data_ptr() == x.data_ptr():  # in place: the first v head follows q and k in the fused qkv
            v_offset = out.storage_offset() + out.shape[1] * out.stride(1)
            out.as_strided((out.shape[0], out.shape[2]), (out.stride(0), 1), v_offset).zero_()
        return out

    def rotates_the_wrong_way(x, cos, sin, out=None):
        return rotate_half(x, cos, -sin, out=out)

    def new_buffer(x, cos, sin, out=None):
        return rotate_half(x, cos, sin)

    assert error(leaves_an_element_unwritten) == check.FAILED
    assert error(writes_the_v_heads) == check.FAILED
    assert error(new_buffer) == check.FAILED
    assert error(rotates_the_wrong_way) > 0.05


def test_selection_without_cuda_keeps_the_references():
    choice = select.select_fast_kernels(SimpleNamespace(device=torch.device("cpu")), page_size=16)
    assert set(choice) == set(select.FAST_KERNELS)
    assert all(v.implementation == "reference" and not v.check_failed for v in choice.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_prefill_attention_is_not_a_failed_check_on_an_fp32_model(monkeypatch, dtype):
    """FlashAttention takes fp16 and bf16 only: an fp32 model (the demo's default dtype) keeps the
    reference prefill attention without a failed check (which failed `hylora doctor --demo` on every
    GPU); on a bf16 model the same error is a failed check. Every other check is stubbed to pass."""
    for name in dir(check):
        if name.endswith("_error"):
            monkeypatch.setattr(check, name, lambda *args, **kwargs: 0.0)

    def flash_on_fp32(*args, **kwargs):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    monkeypatch.setattr(check, "prefill_attention_error", flash_on_fp32)
    monkeypatch.setattr(check, "lora_shapes", lambda model: [(32, [24, 8])])
    monkeypatch.setattr(select, "triton_usable", lambda device: True)
    shapes = Mock()  # the stubs ignore the shapes
    model = SimpleNamespace(device=torch.device("cuda"), config=shapes, dtype=dtype, visual=None)
    verdicts = select.select_fast_kernels(model, page_size=16)
    assert set(verdicts) == set(select.FAST_KERNELS)
    attention = verdicts["prefill_attention"]
    assert attention.implementation == "reference"
    if dtype == torch.float32:
        assert not attention.check_failed and "fp32" in attention.reason
    else:
        assert attention.check_failed and "only support fp16 and bf16" in attention.reason
    assert not any(v.check_failed for name, v in verdicts.items() if name != "prefill_attention")


def test_verdict():
    ok = select._verdict("x", lambda: 1e-7, 1e-4)
    assert ok.fast and ok.implementation == "triton" and ok.error == 1e-7 and not ok.check_failed
    for error in (float("nan"), 1.0):
        bad = select._verdict("x", lambda error=error: error, 1e-4)
        assert not bad.fast and bad.check_failed

    def fails():
        raise RuntimeError("no sm_90 here")

    crashed = select._verdict("x", fails, 1e-4)
    assert crashed.check_failed and "no sm_90 here" in crashed.reason


def test_a_slow_start_up_check_logs_its_time(monkeypatch, caplog):
    """A cold start's minutes show where they went: each check past SLOW_CHECK_S is logged with its time."""
    caplog.set_level("INFO", logger=select.log.name)
    select._verdict("quick", lambda: 0.0, 1e-4)
    assert not [r for r in caplog.records if "start-up check took" in r.getMessage()]
    monkeypatch.setattr(select, "SLOW_CHECK_S", -1.0)
    select._verdict("slow", lambda: 0.0, 1e-4)
    (line,) = [r.getMessage() for r in caplog.records if "start-up check took" in r.getMessage()]
    assert line.startswith("slow triton start-up check took ")


@pytest.mark.parametrize(
    "errors, implementation, checked, dequantised",
    [
        ({"cublas": 1e-4}, "cublas+triton", ["cublas"], False),  # as it serves: Triton's prefill tiles not compiled
        ({"cublas": 1.0, "triton": 1e-4}, "triton", ["cublas", "triton"], False),
        ({"cublas": "raises", "triton": 1e-4}, "triton", ["cublas", "triton"], False),  # e.g. no block-scaled cuBLAS
        ({"cublas": 1.0, "triton": float("nan")}, "reference", ["cublas", "triton"], True),
        ({"deepgemm": 1e-4}, "deepgemm+cublas+triton", ["deepgemm"], False),  # installed: checked first
        ({"deepgemm": float("nan"), "cublas": 1e-4}, "cublas+triton", ["deepgemm", "cublas"], False),
        ({"deepgemm": "raises", "cublas": 1.0, "triton": 1e-4}, "triton", ["deepgemm", "cublas", "triton"], False),
    ],
)
def test_fp8_gemm_is_checked_as_it_serves_then_falls_back(errors, implementation, checked, dequantised):
    """DeepGEMM where installed, then cuBLAS with Triton below, are checked first; a failure falls back to
    the next, down to Triton alone, and a failure of that to dequantised weights; the verdict names what
    serves and, on failure, why."""
    seen, dequantize = [], Mock()

    def check(module):
        def run():
            seen.append(module)
            if errors[module] == "raises":
                raise RuntimeError("blockwise scaling needs sm_90")
            return errors[module]

        return run

    verdict = select.choose_fp8_gemm(check, dequantize, deepgemm="deepgemm" in errors)
    assert verdict.implementation == implementation and seen == checked
    assert dequantize.called == dequantised == verdict.check_failed
    if dequantised:
        assert "weights dequantised" in verdict.reason
    kernels = select.model_kernels({"fp8_linear": verdict})
    want = {i: f"hylora.ops.fp8_linear.{m}" for i, m in select.FP8_MODULES.items()}
    want["triton"] = "hylora.ops.fp8_linear.triton"
    assert kernels.fp8_linear.__module__ == want.get(implementation, "hylora.ops.fp8_linear.reference")


@pytest.mark.parametrize("gemm", ["cublas+triton", "deepgemm+cublas+triton", "triton", "reference"])
def test_split_producers_split_where_the_split_gemm_takes_the_terms(gemm, monkeypatch):
    """--fp8-activations split: the norms, the activation and the output gate that quantise for the FP8
    projection behind them write both terms where the split GEMM reads them. Where cuBLAS serves, steps from SPLIT_BELOW
    tokens take the weight-only path (x as it is): those get the plain values, which the layers pass
    on as they are. Triton's split GEMM alone splits at every size. Dynamic activations: one term."""
    from hylora.kernels import KernelsConfig
    from hylora.kernels.verdict import passed, reference
    from hylora.ops.fp8_linear import cublas
    from hylora.ops.fp8_linear.reference import QuantizedActivation
    from hylora.ops.output_gate import reference as gates
    from hylora.ops.rmsnorm import reference as norms
    from hylora.ops.silu_mul import reference as activations

    monkeypatch.setattr(cublas, "SPLIT_BELOW", 8)
    verdicts = {"fp8_linear": passed("fp8_linear", gemm, 0.0, 1e-2)}
    producers = ("silu_mul_quantized", "rms_norm_quantized", "output_gate_quantized")
    verdicts |= {name: reference(name, "the CPU") for name in producers}
    kernels = select.model_kernels(verdicts, KernelsConfig(fp8_activations="split"))
    g = torch.Generator().manual_seed(0)
    for tokens in (7, 8):
        x, res = torch.randn(tokens, 256, generator=g), torch.randn(tokens, 256, generator=g)
        heads, gate = torch.randn(tokens, 2, 128, generator=g), torch.randn(tokens, 2, 128, generator=g)
        w, gate_up = torch.randn(256, generator=g) * 0.1, torch.randn(tokens, 512, generator=g)
        produced = {
            "norm": (kernels.rms_norm_quantized(x, w, 1e-6), norms.rms_norm(x, w, 1e-6)),
            "residual": (kernels.rms_norm_quantized(x, w, 1e-6, res)[0], norms.rms_norm(x, w, 1e-6, res)[0]),
            "gated": (kernels.gated_rms_norm_quantized(heads, gate, w[:128], 1e-6), None),
            "act": (kernels.silu_mul_quantized(gate_up), activations.silu_mul(gate_up)),
            "output gate": (kernels.output_gate_quantized(heads, gate), gates.output_gate(heads, gate)),
        }
        splits = tokens < 8 or gemm in ("triton", "reference")  # these split at every size
        for name, (got, plain) in produced.items():
            assert isinstance(got, QuantizedActivation) == splits, name
            if splits:
                assert got.lo is not None, name
            elif plain is not None:
                assert torch.equal(got, plain), name
    dynamic = select.model_kernels(verdicts, KernelsConfig())
    assert dynamic.rms_norm_quantized is norms.rms_norm_quantized
    assert dynamic.silu_mul_quantized(torch.randn(8, 512)).lo is None
    assert dynamic.output_gate_quantized is gates.output_gate_quantized
    # the activation with gate_up's LoRA expand, where it quantises (KernelsConfig.fused_lora_expand_quantized)
    calls = []
    fused = passed("silu_mul_lora", "triton", 0.0, 1e-2)
    config = KernelsConfig(fp8_activations="split", fused_lora_expand_quantized=True)
    monkeypatch.setattr("hylora.ops.silu_mul.triton.silu_mul_lora", lambda *a, **k: calls.append((a[4:], k)))
    act = select.model_kernels(verdicts | {"silu_mul_lora": fused}, config).silu_mul_lora
    for tokens, group in ((7, 128), (7, None), (8, 128)):
        act(torch.empty(tokens, 512), None, [], None, group, True)
    split, plain = ((128, True), {"split": True}), ((), {})
    assert calls == [split, plain, split if gemm in ("triton", "reference") else plain]  # 8: plain where cuBLAS serves


def test_verdicts_choose_the_model_kernels():
    from hylora.kernels import KernelsConfig
    from hylora.ops.rmsnorm.reference import rms_norm

    kernels = select.model_kernels({"rms_norm": select._verdict("rms_norm", lambda: float("nan"), 1e-4)})
    assert kernels.rms_norm is rms_norm and kernels.lora_backend is None  # failed: the reference serves
    forced = select.model_kernels({}, KernelsConfig(lora_backend="masked"))
    assert forced.lora_backend == forced.tower_lora_backend == "masked"
    assert forced.lora_delta_first_from == 0  # the delta first is a path of the Triton LoRA only
    lora = {"lora": select._verdict("lora", lambda: 0.0, 1e-4)}
    assert select.model_kernels(lora).lora_delta_first_from == KernelsConfig().lora_delta_first_from
    assert select.model_kernels(lora, KernelsConfig(lora_delta_first_from=2048)).lora_delta_first_from == 2048
    with pytest.raises(ValueError, match="lora_delta_first_from must be >= 0"):
        KernelsConfig(lora_delta_first_from=-1)


def test_lora_delta_first_flag_reaches_the_kernel_config():
    import argparse

    from hylora.kernels import KernelsConfig
    from hylora.server.serve import add_serve_args, kernels_config

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert kernels_config(p.parse_args(["m"])) == KernelsConfig()
    assert kernels_config(p.parse_args(["m", "--lora-delta-first-from", "0"])).lora_delta_first_from == 0
    assert kernels_config(p.parse_args(["m", "--lora-delta-first-from", "2048"])).lora_delta_first_from == 2048


def test_installed_kernels_give_every_linear_its_lora_path():
    from hylora.config import ModelConfig
    from hylora.model.decoder import HybridDecoder
    from hylora.model.kernels import ModelKernels, install
    from hylora.model.layers import Linear

    with torch.device("meta"):
        model = HybridDecoder(ModelConfig.from_hf({"model_type": "qwen3_5_text", **text_config()}))
    install(model, ModelKernels(lora_backend="triton", lora_delta_first_from=2048))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.lora_backend == "triton" and m.delta_first_from == 2048 for m in linears)
    install(model, ModelKernels())
    assert all(m.lora_backend is None and m.delta_first_from == 0 for m in linears)


def test_kernels_flag_sets_any_kernel_field_and_says_what_is_wrong():
    import argparse
    import re

    from hylora.kernels import KernelsConfig
    from hylora.kernels.config import kernel_switches, parse_kernel_overrides
    from hylora.server.serve import add_serve_args, kernels_config

    p = argparse.ArgumentParser()
    add_serve_args(p)
    text = "decode_attention_block_t=64,decode_attention_pv_16bit=0,tower_attention=cudnn"
    config = kernels_config(p.parse_args(["m", "--kernels", text]))
    assert (config.decode_attention_block_t, config.decode_attention_pv_16bit, config.tower_attention) == (
        64, False, "cudnn"
    )  # fmt: skip
    assert config.fp8_fused_norm_quant is KernelsConfig().fp8_fused_norm_quant  # untouched fields keep defaults
    assert parse_kernel_overrides(kernel_switches(parse_kernel_overrides(text))) == parse_kernel_overrides(text)
    # the same value by its own flag and by --kernels is fine; two different values are an error
    same = p.parse_args(["m", "--tower-attention", "cudnn", "--kernels", "tower_attention=cudnn"])
    assert kernels_config(same).tower_attention == "cudnn"
    clash = p.parse_args(["m", "--tower-attention", "flash", "--kernels", "tower_attention=cudnn"])
    with pytest.raises(ValueError, match="--tower-attention flash and --kernels tower_attention=cudnn disagree"):
        kernels_config(clash)
    for bad, message in (
        ("decode_attention_blockt=32", "name one of .*decode_attention_block_t"),
        ("decode_attention_pv_16bit=2", re.escape("want name=0|1, name=N")),
        ("decode_attention_block_t=48", "decode_attention_block_t must be 16, 32 or 64"),
        ("tower_attention=fast", "tower_attention must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_kernel_overrides(bad)
        with pytest.raises(SystemExit):  # argparse: exit 2 with the message, before anything loads
            p.parse_args(["m", "--kernels", bad])


def test_decode_attention_defaults_match_the_kernel_module():
    """KernelsConfig (which the engine passes) and the kernel's own defaults (direct calls: benches, tests)
    name the same kernel: the config cannot import the Triton module to read them."""
    pytest.importorskip("triton")
    from hylora.kernels import KernelsConfig
    from hylora.ops.paged_decode_attention import triton as kernel

    config = KernelsConfig()
    assert (config.decode_attention_pv_16bit, config.decode_attention_block_t) == (kernel.PV_16BIT, kernel.BLOCK_T)
