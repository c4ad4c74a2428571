"""The FP8 GEMM tile configurations tests/test_fp8_linear.py runs (compiled on a GPU): here, free of
the tests' interpreter set-up, so that tests/sm90_compile.py can also compile them for Hopper."""

from __future__ import annotations

import dataclasses

from hylora.ops.fp8_linear import triton as T

CONFIGS = {
    "decode1": T.DECODE_1,
    "decode": T.DECODE,
    "decode32": T.DECODE_32,
    "medium": T.MEDIUM,
    "prefill": T.PREFILL,
    "fused-noswap": T.GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, max_split_k=4, fuse_quant=True),
    "swap-unfused": T.GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=2, max_split_k=4, swap_ab=True),
    "wide": T.GemmConfig(block_m=16, block_n=256, num_warps=4, num_stages=2),  # a tile over 2 scale rows
    # TMA tiles where the rows' strides allow it (K a multiple of 16 here), the pointer kernel elsewhere
    "tma-decode": dataclasses.replace(T.DECODE, tma=True),
    "tma-wide-noswap": T.GemmConfig(block_m=16, block_n=256, num_warps=4, num_stages=2, tma=True),
    # the warp-specialised K loop, a sweep candidate (bench/fp8_gemm_gpu.py --sweep-tma), served nowhere
    "tma-ws": dataclasses.replace(T.DECODE, warp_specialize=True),
}
