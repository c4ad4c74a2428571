"""The model's decode path through hylora's Triton kernels (GDN step in place by slot, paged decode
attention), run on CPU under the Triton interpreter: the engine's greedy tokens and logprobs equal
the torch reference path, across page boundaries and with adapters mixed in."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import pytest

from hylora.engine import SamplingParams
from hylora.ops.kernel_check import install_triton_kernels
from tests.engine_helpers import make_engine, run
from tests.helpers import random_ids

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the test extra installs it)")


def test_engine_decode_through_triton_kernels_equals_reference(causal_ckpt, engine_adapter_root):
    requests = [
        (f"r{i}", random_ids(n, 320, seed=40 + i), SamplingParams(max_tokens=6, temperature=0, logprobs=1), adapter)
        for i, (n, adapter) in enumerate([(13, None), (16, "gdn_attn"), (31, "all_linear"), (47, None)])
    ]
    outputs = []
    for fast in (False, True):
        engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=128, page_size=16)
        if fast:
            install_triton_kernels(engine.model, ["gdn_decode", "paged_decode_attention"])
            assert engine.model.layers[0].linear_attn.decode_step is not None
        outputs.append(run(engine, {0: requests}))
    reference, fast = outputs
    for rid, *_ in requests:
        assert fast[rid].token_ids == reference[rid].token_ids, rid
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(fast[rid].logprobs, reference[rid].logprobs, strict=True))
        assert diff <= 1e-4, (rid, diff)
