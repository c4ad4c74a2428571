"""`KernelsConfig.gdn_single_tokens_recurrent`: an eager prefill step's leading one-token sequences (the
decode rows beside prompt chunks) go through the token-by-token GDN delta rule, in place by state
slot, and the rest through the chunked one. The engine gives the same tokens and logprobs as with
every sequence chunked, with the torch reference and with the Triton kernel (under the interpreter),
and the split really ran; state slots and KV pages not yet owned hold NaN, so a row read from the
wrong slot would fail its request."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

from hylora.kernels import model_kernels  # noqa: E402
from hylora.kernels.config import KernelsConfig  # noqa: E402
from hylora.kernels.select import fast_verdicts  # noqa: E402
from hylora.model import gdn  # noqa: E402
from tests.decode_helpers import nan_fill_unowned  # noqa: E402
from tests.engine_helpers import assert_all_freed, greedy, make_engine, max_logprob_diff, run  # noqa: E402
from tests.helpers import random_ids  # noqa: E402


def test_leading_single_tokens():
    assert gdn.leading_single_tokens([1, 1, 1, 40, 1, 17]) == 3
    assert gdn.leading_single_tokens([40, 1, 1]) == 0  # not at the head: no split
    assert gdn.leading_single_tokens([1, 1]) == 0  # all one token: a decode step, nothing to split
    assert gdn.leading_single_tokens([]) == 0


def counted(kernel, calls: list[int]):
    def run_counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return kernel(q, *args, **kwargs)

    return run_counted


@pytest.mark.parametrize("fast", [False, True], ids=["references", "triton-interpreted"])
def test_decode_rows_token_by_token_give_the_same_engine_output(causal_ckpt, engine_adapter_root, fast):
    # prompts arrive while others decode: their chunks (up to 80 tokens a step: past the 64 that a step
    # of short chunks runs token by token whole) follow the decode rows
    arrivals = {
        0: [
            ("a", random_ids(30, 320, seed=1), greedy(12), None),
            ("b", random_ids(9, 320, seed=2), greedy(14), "gdn_attn"),
        ],
        3: [("late", random_ids(150, 320, seed=3), greedy(6), "all_linear")],
        6: [("later", random_ids(100, 320, seed=4), greedy(5), "rs_mlp")],
    }
    outs, calls, splits = {}, [], []
    real_split = gdn.leading_single_tokens

    def split_recorded(seq_lens):
        n = real_split(seq_lens)
        splits.extend([n] if n else [])
        return n

    for split in (False, True):
        config = KernelsConfig(gdn_single_tokens_recurrent=split)
        e = make_engine(
            causal_ckpt[0], engine_adapter_root, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=80,
            kernels=config, enable_prefix_caching=False,  # (its snapshot points would cut the chunks at 64)
        )  # fmt: skip
        if fast and split:  # the GPU's token-by-token kernel; the chunked one stays the reference
            kernels = model_kernels(fast_verdicts(["gdn_recurrent"]), config)
            e.model.use_kernels(dataclasses.replace(kernels, gdn_recurrent=counted(kernels.gdn_recurrent, calls)))
        nan_fill_unowned(e)
        with (
            mock.patch.object(gdn, "recurrent_by_slot_reference", counted(gdn.recurrent_by_slot_reference, calls)),
            mock.patch.object(gdn, "leading_single_tokens", split_recorded),
        ):
            outs[split] = run(e, arrivals)
        assert_all_freed(e)
        assert (len(splits) > 0) == split and (len(calls) > 0) == split
    assert max(splits) >= 2  # steps with several decode rows beside a long prompt chunk
    for rid, plain in outs[False].items():
        assert outs[True][rid].error is None and outs[True][rid].token_ids == plain.token_ids, rid
        assert max_logprob_diff(outs[True][rid], plain) <= (1e-4 if fast else 1e-5), rid
