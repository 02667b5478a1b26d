"""Streams and events: the only file that knows whether a device has them.

On a device with streams (CUDA and alike) an all-gather is packed and issued on the ``copy_in`` stream and copied out
on the current one; reductions run on the ``reduce_scatter`` stream (the waits between them: docs/design.md, "Streams").
No buffer is ever handed to ``Tensor.record_stream``: a buffer used on another stream stays referenced until an event
proves its last consumer finished (``Streams.hold_all_gather``). On the CPU every method is a no-op on the same code
path; tests pass a recording ``Backend``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch


class Backend(Protocol):
    """The stream operations fully_shard needs: the real one, or a recording test double."""

    def current_stream(self, device: torch.device) -> Any: ...
    def new_stream(self, device: torch.device, name: str) -> Any: ...
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def wait_stream(self, waiter: Any, waited: Any) -> None: ...
    def record_event(self, stream: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...


class _TorchBackend:
    """``torch.Stream`` / ``torch.Event`` through the generic accelerator API."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    def new_stream(self, device: torch.device, name: str) -> Any:
        return torch.Stream(device=device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        # torch.Stream is a context manager that makes it current
        return cast(contextlib.AbstractContextManager[Any], stream)

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` runs work asynchronously on streams (CUDA, XPU, ...), unlike the CPU."""
    return device.type not in ("cpu", "meta")


def accelerator_type() -> str:
    """This machine's accelerator type, else ``"cuda"``: the type that stands for "a device with streams" where none is
    at hand (the memory planner's default). The only place fully_shard spells a device name."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cuda"


class Streams:
    """The side streams of one root, or no-ops on a device without streams."""

    def __init__(self, device: torch.device, backend: Backend | None = None) -> None:
        """``backend``: a test double to route every stream operation through (on any device,
        the CPU too; install it with ``share_comm_ctx``'s seam, ``FSDPState.shared_streams``)."""
        self.device = device
        if backend is None and has_streams(device):
            backend = _TorchBackend()
        self.backend = backend
        if backend is not None:
            self.copy_in = backend.new_stream(device, "copy_in")
            self.reduce_scatter = backend.new_stream(device, "reduce_scatter")
        self._held_all_gather: tuple[tuple[Any, ...], Any] | None = None  # (buffers, event): see hold_all_gather
        self._host_event: Any = None  # see host_waits

    def current(self) -> Any:
        return self.backend.current_stream(self.device) if self.backend is not None else None

    def use(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Make the named side stream current (no-op without streams)."""
        return contextlib.nullcontext() if self.backend is None else self.backend.use(getattr(self, name))

    def wait_for_current(self, name: str) -> None:
        """The named side stream waits for the work queued so far on the current stream."""
        if self.backend is not None:
            self.backend.wait_stream(getattr(self, name), self.current())

    def detour(self, stream: Any, fn: Callable[[], None]) -> None:
        """``fn()`` on ``stream`` (a user's; None: the current one), after the work queued so far
        on the current stream, which then waits for it."""
        if self.backend is None or stream is None:
            return fn()
        here = self.current()
        self.backend.wait_stream(stream, here)
        with self.backend.use(stream):
            fn()
        self.backend.wait_stream(here, stream)

    def current_waits(self, event: Any) -> None:
        if self.backend is not None and event is not None:
            self.backend.wait_event(self.current(), event)

    def record(self, name: str | None = None) -> Any:
        """An event after the work queued so far on the named stream (default: current)."""
        if self.backend is None:
            return None
        return self.backend.record_event(self.current() if name is None else getattr(self, name))

    def hold_all_gather(self, *buffers: Any) -> None:
        """Keep an all-gather's buffers until the copy-in stream has waited for an event recorded after their copy-out
        (on the current stream): the next copy-in may then reuse the memory. Releases the previously held ones first."""
        if self.backend is None:
            return
        self.release_all_gather()
        self._held_all_gather = (buffers, self.record())

    def release_all_gather(self) -> None:
        """Before the copy-in stream allocates again: wait for the held buffers' last use, then drop them."""
        held, self._held_all_gather = self._held_all_gather, None
        if held is not None and self.backend is not None:
            self.backend.wait_event(self.copy_in, held[1])

    def host_waits(self, event: Any) -> None:
        """The host will wait for ``event`` at ``wait_host`` (the end of backward): it follows copies into pinned host
        memory (offloaded gradients) that nothing may read before. A later event on the same stream replaces it."""
        self._host_event = event

    def wait_host(self) -> None:
        """Block the host until the event of ``host_waits`` has happened (no-op without one)."""
        event, self._host_event = self._host_event, None
        if event is not None and self.backend is not None:
            self.backend.synchronize(event)

    def wait_for_optimizer(self, post_optim_event: Any) -> None:
        """The first copy-in of an iteration waits for the optimizer step: for the user's
        event if given, else for everything queued on the current stream."""
        if self.backend is not None and post_optim_event is not None:
            self.backend.wait_event(self.copy_in, post_optim_event)
        else:
            self.wait_for_current("copy_in")
