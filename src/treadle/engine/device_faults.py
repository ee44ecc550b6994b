"""Which errors leave a device unusable (what the server does then: treadle.protocol.faults).

A CUDA error other than out-of-memory (an illegal address, a device-side assert, an ECC
error, a lost device) poisons the process's CUDA context: every later call on it fails too,
and only a new process gets a working device. torch raises those as AcceleratorError. Any
other error (not a request's own) is checked by running a one-element kernel on the device.
"""

from __future__ import annotations

from typing import Any

from treadle.errors import TreadleError


def is_device_fault(exc: BaseException, device: Any = None) -> bool:
    """Whether `exc`, raised by an engine call on `device`, left the device unusable."""
    import torch  # here: the API process, which imports this module too, never loads torch

    if isinstance(exc, TreadleError | torch.OutOfMemoryError):
        return False  # a request's own error, or memory that frees with the request
    if isinstance(exc, torch.AcceleratorError):
        return True  # torch's type for CUDA/XPU runtime errors (OOM has its own type)
    return not device_usable(device)


def device_usable(device: Any) -> bool:
    """Runs a tiny kernel on an accelerator and waits for it (a CPU is always usable)."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return True
    try:
        probe = torch.ones(1, device=device)
        torch.accelerator.synchronize(device)
        return float(probe.add_(1).cpu()) == 2.0
    except Exception:
        return False
