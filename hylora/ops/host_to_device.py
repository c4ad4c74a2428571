"""A host array as a device tensor, queued behind the device's work instead of waiting for it.

A plain copy from pageable memory (`torch.tensor(..., device="cuda")`, `.to("cuda")`) waits until the
device has finished everything queued before it; a step's inputs copied that way stall the host
behind the previous step's tail. Through page-locked memory the copy is queued like a kernel (torch's
host allocator keeps the buffer until the copy has run). The staging copy into page-locked memory
costs host time (a host memcpy), not device time.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(values: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`values` (a numpy array or a tensor) on `device`; on the CPU the same memory, no copy; a tensor
    already on a device is moved as `.to` moves it."""
    t = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
