"""The step-time model of ``fit()``: named device parameters (``DeviceProfile``) and a schedule of one step's compute
and collectives on two queues (``step_time``).

A step is the groups' forward in order, then their backward in reverse. Compute runs on one queue, collectives on
another (one link: they run one after the other). A group's all-gather is issued when the group ``prefetch`` places
before it starts computing (the first ones at the start of the step) and its compute waits for it; a reduce-scatter
is issued when its group's backward is done and, with ``buffers`` reduce-scatter inputs allowed in flight, the next
group's post-backward waits for the one ``buffers`` before. The step ends when both queues are empty. A collective of
``B`` bytes of output over ``n`` ranks takes ``(n-1)/n * B / bandwidth``, within a node (``n <= ranks_per_node``) or
across nodes; CPU offload adds the host-device copies of the sharded parameters and gradients, not overlapped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["DeviceProfile", "PROFILES", "GroupCost", "step_time", "measure_profile"]


@dataclass(frozen=True)
class DeviceProfile:
    """What the step-time model knows of a machine: sustained matmul FLOP/s per rank (``flops``: in the 16-bit
    compute dtype; ``fp32_flops``: without mixed precision), the bytes/s a rank sends in a ring collective within a
    node and across nodes, ranks per node, host-device copies (``host_bandwidth``) and device memory.

    Example::

        >>> PROFILES["h100"].intra_node_bandwidth / 1e9  # GB/s a rank sends over NVLink in a ring
        360.0
    """

    name: str
    flops: float  # FLOP/s sustained by matmuls in bf16/fp16
    fp32_flops: float  # FLOP/s sustained in fp32 (TF32 off, torch's default)
    intra_node_bandwidth: float  # bytes/s per rank, ring collectives within a node
    inter_node_bandwidth: float  # bytes/s per rank, ring collectives across nodes
    ranks_per_node: int
    host_bandwidth: float  # bytes/s per rank, host <-> device copies (CPU offload)
    memory_bytes: int  # device memory

    def bandwidth(self, ranks: int) -> float:
        return self.intra_node_bandwidth if ranks <= self.ranks_per_node else self.inter_node_bandwidth


# Published peaks derated to what large training jobs sustain: ~55% of dense bf16 (989 TFLOP/s on both), NVLink 4
# at 450 GB/s a direction of which ~80% in a ring, 400 Gb/s InfiniBand per GPU (~45 GB/s), PCIe 5 x16 (~50 GB/s).
PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", flops=545e12, fp32_flops=37e12, intra_node_bandwidth=360e9,
                          inter_node_bandwidth=45e9, ranks_per_node=8, host_bandwidth=50e9, memory_bytes=80 * 2**30),
    "h200": DeviceProfile("h200", flops=545e12, fp32_flops=37e12, intra_node_bandwidth=360e9,
                          inter_node_bandwidth=45e9, ranks_per_node=8, host_bandwidth=50e9, memory_bytes=141 * 10**9),
}


@dataclass
class GroupCost:
    """One ``fully_shard`` call in the step, as the model sees it: seconds of forward compute (backward: twice, plus
    any recompute), of its forward all-gather, of its backward all-gather (0: kept from forward) and of its
    reduce-scatter."""

    name: str
    forward: float
    recompute: float
    all_gather: float
    backward_all_gather: float
    reduce_scatter: float


def step_time(groups: list[GroupCost], *, prefetch: int = 1, buffers: int = 1, offload: float = 0.0) -> float:
    """Seconds of one step of ``groups`` (in forward order) on the two queues of the module docstring.

    Example::

        >>> g = [GroupCost("block", 1.0, 0.0, 0.5, 0.5, 0.5) for _ in range(4)]
        >>> step_time(g)  # 12 s of compute; the first all-gather, the last reduce-scatter and one gather not hidden
        13.5
    """
    compute = link = 0.0  # when each queue is next free
    ready: dict[tuple[str, int], float] = {}  # (pass, group) -> when its all-gather is done

    def gather(key: tuple[str, int], seconds: float, issued: float) -> None:
        nonlocal link
        if key not in ready:
            link = max(link, issued) + seconds
            ready[key] = link

    m = len(groups)
    for i in range(m):  # forward: its own all-gather (unless prefetched), then the next ones, then compute
        gather(("forward", i), groups[i].all_gather, compute)
        begin = max(compute, ready[("forward", i)])
        for k in range(i + 1, min(m, i + prefetch + 1)):
            gather(("forward", k), groups[k].all_gather, begin)
        compute = begin + groups[i].forward
    scatters: list[float] = []
    for j in range(m):  # backward, last group first; a group kept after forward gathers in no time
        i = m - 1 - j
        gather(("backward", i), groups[i].backward_all_gather, compute)
        begin = max(compute, ready[("backward", i)])
        for k in range(i - 1, max(-1, i - prefetch - 1), -1):
            gather(("backward", k), groups[k].backward_all_gather, begin)
        compute = begin + 2 * groups[i].forward + groups[i].recompute
        if len(scatters) >= buffers:  # its reduce-scatter input waits for the one `buffers` before to be free
            compute = max(compute, scatters[-buffers])
        link = max(link, compute) + groups[i].reduce_scatter
        scatters.append(link)
    return max(compute, link) + offload


def measure_profile(memory_bytes: int | None = None) -> DeviceProfile:
    """A profile fitted on this machine: matmul FLOP/s in bf16 and fp32 on this process's accelerator (else the
    CPU), and, with ``torch.distributed`` initialised, the bytes/s of an all-gather over the default group (else the
    device's copy bandwidth) for both links and for host copies.

    Example::

        >>> p = measure_profile()
        >>> p.name, p.flops > 0, p.intra_node_bandwidth > 0
        ('measured', True, True)
    """
    import torch.distributed as dist

    from ...streams import accelerator_type

    device = torch.device(accelerator_type() if torch.accelerator.is_available() else "cpu")

    def timed(fn: object, repeat: int = 3) -> float:
        assert callable(fn)
        fn()  # warm-up
        sync = getattr(torch, device.type, None)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            if device.type != "cpu" and sync is not None:
                sync.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    n = 2048 if device.type != "cpu" else 256
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        rates[dtype] = 2 * n**3 / timed(lambda a=a: a @ a)
    buf = torch.empty(2**24, dtype=torch.uint8, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        out = torch.empty(world * buf.numel(), dtype=torch.uint8, device=device)
        link = (world - 1) * buf.numel() / timed(lambda: dist.all_gather_into_tensor(out, buf))
    else:
        link = buf.numel() / timed(lambda: buf.clone())
    memory = memory_bytes if memory_bytes is not None else 0
    if memory_bytes is None and device.type != "cpu":
        memory = torch.accelerator.get_memory_info()[1]
    world = dist.get_world_size() if dist.is_initialized() else 1
    return DeviceProfile("measured", flops=rates[torch.bfloat16], fp32_flops=rates[torch.float32],
                         intra_node_bandwidth=link, inter_node_bandwidth=link, ranks_per_node=max(world, 1),
                         host_bandwidth=link, memory_bytes=memory)
