"""The engine's errors: what a request did wrong, and what the device did."""

from __future__ import annotations

import torch


class RequestError(ValueError):
    """The request cannot be served as given; the message says what to change, `param` the field at
    fault where there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DeviceFault(RuntimeError):
    """The accelerator failed (e.g. an illegal memory access): every request in flight is lost and
    the device state cannot be trusted; the process must restart."""


def is_device_error(error: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in ("CUDA error", "CUBLAS_STATUS", "cuDNN error"))
