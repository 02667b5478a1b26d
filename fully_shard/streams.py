"""Device streams and events; every function is a no-op on devices without streams (CPU)."""

from __future__ import annotations

import torch


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` runs work asynchronously on streams (CUDA, XPU, ...), unlike the CPU."""
    return device.type not in ("cpu", "meta")


def current_stream_wait(device: torch.device, event: torch.Event | None) -> None:
    """Make the current stream of ``device`` wait for ``event`` (the CPU has nothing to wait for)."""
    if event is not None and has_streams(device):
        torch.accelerator.current_stream(device).wait_event(event)
