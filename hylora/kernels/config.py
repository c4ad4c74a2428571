"""The kernel floor's knobs (one dataclass, set by `hylora serve` flags; part of EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hylora.env import triton_interpreter
from hylora.model.layers import LORA_BACKENDS

FAST_KERNEL_CHOICES = ("auto", "off")
GDN_BACKENDS = ("auto", "reference", "fla")


@dataclass(frozen=True)
class KernelsConfig:
    # auto: each fast kernel serves once it passed its start-up check; off: the torch references
    # (the GDN prefill kernel has gdn_backend)
    fast_kernels: str = "auto"
    # the chunked gated delta rule of prefill. auto: fla for 16-bit models when it passes its check
    # (fp32 models keep the exact reference: fla computes in TF32); fla: required, or start-up fails
    gdn_backend: str = "auto"
    # LoRA arithmetic in every linear. auto: hylora's Triton kernels once they passed their check,
    # else masked on CUDA and grouped on the CPU; grouped / masked / triton force one
    lora_backend: str = "auto"
    # hylora's GDN decode kernel's launch (block_v, num_warps, v_blocks); None: its defaults (tuned on
    # an H200). Another card: the pick of bench/kernel_sweep_gpu.py --gdn-best-out
    gdn_decode_launch: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        launch = self.gdn_decode_launch
        if launch is not None and (len(launch) != 3 or any(not isinstance(v, int) or v < 1 for v in launch)):
            raise ValueError(f"gdn_decode_launch must be three positive integers, got {launch!r}")
        for name, allowed in (
            ("fast_kernels", FAST_KERNEL_CHOICES),
            ("gdn_backend", GDN_BACKENDS),
            ("lora_backend", ("auto", *LORA_BACKENDS)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


def triton_usable(device: torch.device | str) -> bool:
    """Triton importable and able to run here: a CUDA device, or Triton's CPU interpreter
    (TRITON_INTERPRET=1, Triton's own switch: the tests run the kernels' logic that way)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if torch.device(device).type == "cuda":
        return True
    return torch.device(device).type == "cpu" and triton_interpreter()


def parse_launch(text: str) -> tuple[int, int, int]:
    """`block_v,num_warps[,v_blocks]` (v_blocks defaults to 1) as gdn_decode_launch."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"expected block_v,num_warps[,v_blocks] (integers), got {text!r}") from None
    if len(values) not in (2, 3):
        raise ValueError(f"expected block_v,num_warps[,v_blocks], got {text!r}")
    return tuple((values + [1])[:3])  # type: ignore[return-value]
