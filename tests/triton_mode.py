"""Which Triton a kernel test runs: the interpreter on CPU tensors (a machine without CUDA) or the
compiled kernels on a GPU. TRITON_INTERPRET must be set before triton is imported, and only where
there is no CUDA: set on a GPU machine it would turn every kernel a pytest session imports later
(fla's too, under transformers' reference model) into the interpreter's."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch


def interpret_without_cuda() -> None:
    """Kernel tests that run either way: the interpreter only where there is no CUDA."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU has no Triton backend


def interpreter_only() -> None:
    """CPU tests through the interpreter: skipped on a CUDA machine (which runs the compiled ones)."""
    if torch.cuda.is_available():
        pytest.skip("CPU tests through Triton's interpreter (a GPU runs the compiled ones)", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_device(kernel: Any) -> str:
    """The device to test `kernel` on: cpu where it was imported interpreted, cuda where compiled.
    The module is skipped where it was compiled with no CUDA to run it (TRITON_INTERPRET unset on a
    CPU-only machine)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("the kernels were imported compiled (no TRITON_INTERPRET) with no CUDA", allow_module_level=True)
    return "cuda"
