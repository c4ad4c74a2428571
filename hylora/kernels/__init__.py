"""Kernel selection, a floor above the model: every fast kernel is checked against its torch
reference on the model's shapes at start-up and serves only if it passes (`select_kernels`); the
verdicts are records (`KernelVerdict`) the engine keeps and `hylora doctor` reads."""

from hylora.kernels.config import KernelsConfig, serve_fp8, triton_usable
from hylora.kernels.select import FAST_KERNELS, model_kernels, select_kernels
from hylora.kernels.verdict import KernelVerdict, as_text

__all__ = [
    "FAST_KERNELS",
    "KernelVerdict",
    "KernelsConfig",
    "as_text",
    "model_kernels",
    "select_kernels",
    "serve_fp8",
    "triton_usable",
]
