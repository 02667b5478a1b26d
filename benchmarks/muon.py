"""Muon optimizer step: ``fully_shard.optim.Muon`` vs ``torch.optim.Muon`` over fully_shard,
over torch's FSDP2, and on the unsharded model.

Gloo jobs (world 2 and 4): the same random gradients every step (each rank gets its rows),
Muon on the 2-D block weights of a small Llama. First, untimed: 3 steps of every
implementation, the max difference from the unsharded run, and the collectives of one step
(``CommDebugMode``: c10d and DTensor ones; it intercepts every op, so no timed step runs under
it). Then timed rounds: each round runs one step of every implementation and of the extra
measurements, the first one rotating (torch's Muon, seconds a step, only every few rounds);
per step the wall time and the process CPU time of each rank, per round the slowest rank,
then medians over the rounds. The all-to-all time is Muon's own owner round trip with the
Newton-Schulz and elementwise work left out; beside it, the two all-to-alls alone and the
alternative of two all-gathers (every rank receives every matrix, W times the bytes). The
goal (ours <= 1.2 x unsharded / W + all-to-all) is checked on the medians and round by round.

Simulation (fake process group, one process, rank 0 of W = 64 and 1024): the block
matrices of a Llama 3.2 3B as DTensors sharded over W ranks; one owner round trip with the
transform left out records the collectives and the bytes that leave the rank (the self slot
of an all-to-all stays home), against what the layout predicts; Newton-Schulz FLOPs per
rank come from the owner assignment.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from support.llama import LLAMA32_3B, Llama, LlamaArgs

# the model: a 4-block Llama of dim 128, ffn 344
MUON_MODEL = LlamaArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=344, vocab_size=512)
MUON_TINY = LlamaArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=67)
IMPLS = ("unsharded", "fully_shard.optim.Muon", "torch Muon / fully_shard", "torch Muon / torch FSDP2")
SIM_WORLDS = (64, 1024)
ROUND_TRIP, BARE_ALL_TO_ALLS, ALL_GATHERS = "all-to-all round trip", "two all-to-alls alone", "two all-gathers"
LR = 0.02


def _block_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2]


def _rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(like, DTensor):
        return full.clone()
    world, rank = like.device_mesh.size(0), like.device_mesh.get_local_rank(0)
    chunk = math.ceil(full.shape[0] / world)
    start = min(rank * chunk, full.shape[0])
    local = full[start : min(start + chunk, full.shape[0])].clone()
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def _build(impl: str, args: LlamaArgs, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Llama(args)
    if impl != "unsharded":
        if impl == "torch Muon / torch FSDP2":
            from torch.distributed.fsdp import fully_shard
        else:
            from fully_shard import fully_shard  # type: ignore[assignment]
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    matrices = _block_matrices(model)
    if impl == "fully_shard.optim.Muon":
        from fully_shard.optim import Muon

        return model, Muon(matrices, lr=LR)
    return model, torch.optim.Muon([p for _, p in matrices], lr=LR)


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for _, p in _block_matrices(model):
        p.grad = _rows(torch.randn(p.shape, generator=gen), p)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _RoundTrip:
    """The owner round trip exactly as ``fully_shard.optim.Muon`` runs it (the plan kept across
    steps, the updates cast into the send buffers, each stack assembled and sent back), with
    the Newton-Schulz and the elementwise work left out: the goal's "all-to-all time"."""

    def __init__(self, model: nn.Module) -> None:
        from fully_shard.optim import newton_schulz_flops
        from fully_shard.optim.owned import _Plan, matrix_layout

        matrices = _block_matrices(model)
        self.layouts = [matrix_layout(p, n) for n, p in matrices]
        self.inputs = [_local(p.grad) for _, p in matrices]
        self.plan = _Plan(self.layouts, [t.shape for t in self.inputs], newton_schulz_flops)

    def step(self) -> None:
        n = len(self.inputs)
        exchange = self.plan.start([torch.bfloat16] * n, [torch.bfloat16] * n, self.inputs[0].device)
        torch._foreach_copy_(exchange.inputs, self.inputs)
        for stack, result in exchange.run():
            result.copy_(stack)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def muon_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from fully_shard.optim import newton_schulz_flops
    from support.collectives import CollectiveRecorder

    args = LlamaArgs(**job["args"])
    rounds, warmup, torch_every = job["rounds"], job["warmup"], job["torch_every"]
    built = {impl: _build(impl, args, world) for impl in IMPLS}
    out: dict[str, Any] = {"impls": {}, "rounds": rounds, "warmup": warmup, "torch_every": torch_every}
    # 1. untimed: 3 steps of each implementation on the same gradients, compared with the
    # unsharded run; the collectives of one step (CommDebugMode intercepts every op, which
    # slows a step several times over, so no timed step runs under it)
    finals: dict[str, dict[str, torch.Tensor]] = {}
    for impl, (model, opt) in built.items():
        for step in range(3):
            _grads(model, step)
            with CommDebugMode() as comm:
                opt.step()
        finals[impl] = {n: _full(p.detach()).clone() for n, p in _block_matrices(model)}
        out["impls"][impl] = {"collectives": comm.get_total_counts()}
    for impl in IMPLS:
        out["impls"][impl]["max_diff"] = max(
            (finals[impl][n] - finals["unsharded"][n]).abs().max().item() for n in finals[impl]
        )
    # Newton-Schulz runs per matrix: torch's Muon runs it on every rank; ours once, on the owner
    for impl in IMPLS:
        out["impls"][impl]["ns_per_matrix"] = world if impl.startswith("torch Muon") else 1

    # what else is timed: the round trip alone; the two all-to-alls alone (replayed with the
    # round trip's split sizes, no copies); and the alternative of two all-gathers (every rank
    # receives every matrix, W times the bytes; the bf16 bucket padded to W equal slots)
    trip = _RoundTrip(built["fully_shard.optim.Muon"][0])
    with CollectiveRecorder() as rec:
        trip.step()
    raw = [(torch.empty(sum(c.output_splits), dtype=torch.bfloat16),
            torch.zeros(sum(c.input_splits), dtype=torch.bfloat16), c)
           for c in _all_to_alls(rec)]
    padded = sum(math.ceil(p.shape[0] / world) * p.shape[1] for _, p in _block_matrices(built["unsharded"][0]))
    gather_send = torch.zeros(padded, dtype=torch.bfloat16)
    gather_recv = torch.empty(padded * world, dtype=torch.bfloat16)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13

    def bare_all_to_alls() -> None:
        for o, i, c in raw:
            dist.all_to_all_single(o, i, list(c.output_splits), list(c.input_splits))

    def all_gathers() -> None:
        for _ in range(2):
            gather(gather_recv, gather_send)

    extra = {ROUND_TRIP: trip.step, BARE_ALL_TO_ALLS: bare_all_to_alls, ALL_GATHERS: all_gathers}

    # 2. timed, round by round: each round runs one step of every implementation and of each
    # extra measurement, the first one rotating, so load that comes and goes hits all of them
    # alike; torch's Muon (hundreds of collectives, ~0.5-3 s a step) joins every torch_every-th
    # round. Per step: wall time (perf_counter) and the CPU time of this rank's process, all
    # its threads (process_time: gloo's threads too, not the time spent waiting)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"wall": [], "cpu": []} for name in (*IMPLS, *extra)}
    for i in range(warmup + rounds):
        timed = i >= warmup
        with_torch = timed and (i - warmup) % torch_every == 0
        names = [n for n in (*IMPLS, *extra) if with_torch or not n.startswith("torch Muon")]
        for name in names[i % len(names):] + names[:i % len(names)]:
            if name in extra:
                run = extra[name]
            else:
                model, opt = built[name]
                _grads(model, i % 3)
                run = opt.step
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if timed:
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)
    every_rank: list[Any] = [None] * world
    dist.all_gather_object(every_rank, samples)
    # per round, the slowest rank (the step ends for the job when it ends on every rank)
    per_round = {name: {kind: [max(vals) for vals in zip(*(r[name][kind] for r in every_rank))]
                        for kind in ("wall", "cpu")}
                 for name in samples}
    for impl in IMPLS:
        out["impls"][impl].update(step_s=statistics.median(per_round[impl]["wall"]),
                                  cpu_s=statistics.median(per_round[impl]["cpu"]),
                                  samples=len(per_round[impl]["wall"]))
    out["all_to_all_s"] = statistics.median(per_round[ROUND_TRIP]["wall"])
    out["all_to_all_cpu_s"] = statistics.median(per_round[ROUND_TRIP]["cpu"])
    out["all_to_all_raw_s"] = statistics.median(per_round[BARE_ALL_TO_ALLS]["wall"])
    out["all_gather_s"] = statistics.median(per_round[ALL_GATHERS]["wall"])
    ours = "fully_shard.optim.Muon"
    out["per_rank"] = {kind: [statistics.median(r[ours][kind]) for r in every_rank] for kind in ("wall", "cpu")}
    out["paired"] = {kind: paired_goal(per_round[ours][kind], per_round["unsharded"][kind], per_round[ROUND_TRIP][kind],
                                       world)
                     for kind in ("wall", "cpu")}
    matrices = _block_matrices(built["unsharded"][0])
    out["ns_flops"] = _flops_per_rank([tuple(p.shape) for _, p in matrices], world)
    out["ns_flops"]["total"] = sum(newton_schulz_flops(p.shape) for _, p in matrices)
    out["matrix_bytes_bf16"] = sum(p.numel() for _, p in matrices) * 2
    out["buckets"] = 1
    return out


def paired_goal(ours: list[float], unsharded: list[float], round_trip: list[float], world: int) -> dict[str, Any]:
    """The goal checked round by round: ``ours / (1.2 x unsharded / W + round trip)`` with the three
    times of the same round (<= 1: met in that round); its median over the rounds and how many
    rounds met it. Less exposed than the medians' check to load that changes between rounds."""
    ratios = [o / (1.2 * u / world + a) for o, u, a in zip(ours, unsharded, round_trip)]
    return {"median_ratio": statistics.median(ratios), "rounds_met": sum(r <= 1 for r in ratios), "rounds": len(ratios)}


def _flops_per_rank(shapes: list[tuple[int, ...]], world: int) -> dict[str, Any]:
    from fully_shard.optim import assign_owners, newton_schulz_flops

    costs = [newton_schulz_flops(s) for s in shapes]
    owners = assign_owners(costs, world)
    per_rank = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
    return {"max_per_rank": max(per_rank), "ideal_per_rank": sum(costs) / world, "largest_matrix": max(costs)}


def _all_to_alls(rec: Any) -> list[Any]:
    """The all-to-alls a ``support.collectives.CollectiveRecorder`` saw, with their split sizes."""
    return [r for r in rec.collectives() if r.kind == "all_to_all"]


def _sent_bytes(record: Any, rank: int) -> int:
    """Bytes of an all-to-all that leave ``rank`` (its own split stays)."""
    size = torch.empty((), dtype=getattr(torch, record.dtype)).element_size()
    return (sum(record.input_splits) - record.input_splits[rank]) * size


def _torch_muon_collectives(shapes: list[tuple[int, int]], mesh: Any) -> dict[str, Any]:
    """``torch.optim.Muon`` over ``Shard(0)`` DTensors (as fully_shard and torch FSDP2 leave
    them) with meta local tensors: the collectives DTensor issues inside one step, and the bytes
    rank 0 sends by ring algorithms (all-gather (W-1) x input, reduce-scatter (W-1)/W x input,
    all-reduce 2 (W-1)/W x input). No data: the local tensors are on the meta device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    world = mesh.size(0)
    factor = {"all_gather_into_tensor": world - 1, "reduce_scatter_tensor": (world - 1) / world,
              "all_reduce": 2 * (world - 1) / world, "all_to_all_single": (world - 1) / world}

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}
            self.sent = 0.0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode)
            name = func.__name__.split(".")[0]
            if func.namespace in ("_c10d_functional", "c10d_functional") and name in factor:
                self.counts[name] = self.counts.get(name, 0) + 1
                self.sent += factor[name] * args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    params = []
    for rows, cols in shapes:
        chunk = math.ceil(rows / world)

        def rank0_rows() -> DTensor:
            local = torch.empty(min(chunk, rows), cols, device="meta")
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)),
                                      stride=(cols, 1))

        p = nn.Parameter(rank0_rows())
        p.grad = rank0_rows()
        params.append(p)
    opt = torch.optim.Muon(params, lr=LR)
    try:
        with Record() as rec:
            opt.step()
    except RuntimeError as e:  # e.g. DTensor's in-place add_ when some ranks hold no rows
        return {"error": str(e).splitlines()[0]}
    return {"collectives": sum(rec.counts.values()), "by_kind": rec.counts, "sent_bytes_rank0": rec.sent}


def simulate_muon(world: int, args: LlamaArgs) -> dict[str, Any]:
    """Rank 0 of ``world`` on the fake process group: one owner round trip over the block
    matrices (bytes recorded from the all-to-all split sizes), the same bytes predicted for
    every rank from the layout, and ``torch.optim.Muon``'s collectives on the same layout."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fully_shard.optim.owned import _Plan, matrix_layout, newton_schulz_flops, owned_matrices_local, sent_bytes
    from support.collectives import CollectiveRecorder

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with torch.device("meta"):
            shapes = [tuple(p.shape) for _, p in _block_matrices(Llama(args))]
        params = []
        for shape in shapes:
            chunk = math.ceil(shape[0] / world)
            local = torch.zeros(min(chunk, shape[0]), shape[1])  # rank 0's rows
            params.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                             stride=(shape[1], 1)))
        layouts = [matrix_layout(p, f"m{i}") for i, p in enumerate(params)]
        inputs = [p.to_local() for p in params]
        outs = [torch.empty(t.shape, dtype=torch.bfloat16) for t in inputs]
        with CollectiveRecorder() as rec:
            for _stack, result in owned_matrices_local(layouts, inputs, outs, comm_dtype=torch.bfloat16):
                result.zero_()  # the fake group moves no data; the transform is not the point here
        buckets = _Plan(layouts, [t.shape for t in inputs], newton_schulz_flops).buckets
        predicted = sent_bytes(shapes, world)  # every rank, from the layout
        matrix_bytes = sum(s[0] * s[1] for s in shapes) * 2
        calls = _all_to_alls(rec)
        measured = sum(_sent_bytes(c, 0) for c in calls)
        return {
            "world": world,
            "matrices": len(shapes),
            "collectives_rank0": len(calls),
            "buckets": len(buckets),
            "sent_bytes_rank0": measured,
            "expected_sent_bytes_rank0": predicted[0],
            "predicted_total_bytes": sum(predicted),
            "analytic_all_ranks_bytes": 2 * (world - 1) / world * matrix_bytes,
            # the analytic formula assumes every owner holds 1/W of its matrix's rows
            "rows_divide": all(s[0] % world == 0 for s in shapes),
            "ns_flops": _flops_per_rank(shapes, world),
            "torch_muon": _torch_muon_collectives(shapes, mesh),
        }
    finally:
        dist.destroy_process_group()


def simulation_job(rank: int, world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    args = LlamaArgs(**job["args"])
    return [simulate_muon(w, args) for w in job["worlds"]]


def run(quick: bool, log: Any) -> dict[str, Any]:
    """All Muon measurements: gloo jobs at world 2 and 4, then the simulation."""
    from .spawn import run_job

    args = MUON_TINY if quick else MUON_MODEL
    out: dict[str, Any] = {"model": args.as_dict(), "steps": [], "simulation": None}
    for world in ((2,) if quick else (2, 4)):
        log(f"[benchmarks] muon step, world {world}")
        rounds = ({"rounds": 2, "warmup": 1, "torch_every": 2} if quick
                  else {"rounds": 40, "warmup": 3, "torch_every": 8})
        res, err, wall = run_job(muon_job, {"args": args.as_dict(), **rounds}, nprocs=world, timeout_s=300)
        out["steps"].append({"world": world, "result": res, "error": err, "wall_s": wall})
    sim_args = MUON_MODEL if quick else LLAMA32_3B
    log("[benchmarks] muon simulation (fake process group)")
    res, err, _ = run_job(simulation_job, {"args": sim_args.as_dict(), "worlds": list(SIM_WORLDS)}, nprocs=1,
                          backend="fake", timeout_s=300)
    out["simulation"] = {"model": "Llama 3.2 3B block matrices" if not quick else "muon model", "points": res,
                         "error": err}
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def goal_lines(res: dict[str, Any], world: int) -> list[str]:
    """The goal check of one world size: on the medians, round by round, and on CPU time."""
    unsharded, ours = res["impls"]["unsharded"], res["impls"]["fully_shard.optim.Muon"]
    goal = 1.2 * unsharded["step_s"] / world + res["all_to_all_s"]
    f = res["ns_flops"]
    lines = [
        f"All-to-all round trip alone (Muon's exchange with no Newton-Schulz): {_ms(res['all_to_all_s'])} "
        f"(its two all-to-alls without the copies: {_ms(res['all_to_all_raw_s'])}; the all-gather alternative, two "
        f"all-gathers of the bucket without copies: {_ms(res['all_gather_s'])}); goal 1.2 x unsharded / {world} + "
        f"all-to-all = {_ms(goal)}: {'met' if ours['step_s'] <= goal else 'NOT met'} ({_ms(ours['step_s'])}, "
        f"{ours['step_s'] / goal:.2f} of the goal).",
    ]
    if "paired" in res:
        pw, pc = res["paired"]["wall"], res["paired"]["cpu"]
        cpu_goal = 1.2 * unsharded["cpu_s"] / world + res["all_to_all_cpu_s"]
        lines += [
            "",
            f"Paired, round by round (ours / (1.2 x unsharded / {world} + all-to-all), the three times of the same "
            f"round): median {pw['median_ratio']:.2f}, goal met in {pw['rounds_met']} of {pw['rounds']} rounds. "
            f"On CPU time: ours {_ms(ours['cpu_s'])} against 1.2 x {_ms(unsharded['cpu_s'])} / {world} + "
            f"{_ms(res['all_to_all_cpu_s'])} = {_ms(cpu_goal)} ({ours['cpu_s'] / cpu_goal:.2f} of it; paired: median "
            f"{pc['median_ratio']:.2f}, met in {pc['rounds_met']} of {pc['rounds']} rounds): the work each rank does, "
            "whether or not it had a core to itself. Ours per rank (median wall / CPU): "
            + ", ".join(f"{_ms(w)} / {_ms(c)}" for w, c in zip(res["per_rank"]["wall"], res["per_rank"]["cpu"])) + ".",
        ]
    lines += [
        "",
        f"Newton-Schulz FLOPs on the busiest rank: {f['max_per_rank'] / 1e6:.1f} M vs total / W = "
        f"{f['ideal_per_rank'] / 1e6:.1f} M (one matrix at most {f['largest_matrix'] / 1e6:.1f} M).",
    ]
    return lines


def render(muon: dict[str, Any]) -> list[str]:
    """Markdown lines of the Muon section."""
    a = muon["model"]
    lines = [
        "## Muon optimizer step",
        "",
        f"Muon on the 2-D block weights of a {a['n_layers']}-block Llama (dim {a['dim']}, ffn {a['ffn_dim']}), "
        "the same gradients for every implementation; `optimizer.step()` time, the collectives in one "
        "(untimed) step (`CommDebugMode`), max |difference| from the unsharded run after 3 steps. "
        "Goal: fully_shard.optim.Muon's step <= 1.2 x unsharded / W + the all-to-all time. "
        "Steps are timed in rounds (one step of each per round, the first one rotating): "
        "per round the slowest rank, then the median over the rounds; torch's Muon joins every few rounds only. "
        "Wall: `time.perf_counter` around `step()`. CPU: `time.process_time` of each rank's process around "
        "`step()` (all its threads, gloo's included; time spent waiting for the other ranks or for a free core "
        "is not in it). The unsharded step runs on every rank at the same time, so each rank runs a whole "
        "step. Every rank is one process with one compute thread: at world 4 on a 2-core machine four ranks "
        "share two cores, so world 4's wall times include waiting for a core and cannot be compared with "
        "unsharded / 4; its CPU times can.",
        "",
    ]
    for entry in muon["steps"]:
        res, world = entry["result"], entry["world"]
        if res is None:
            lines += [f"World {world}: error: {entry['error']}", ""]
            continue
        lines += [f"### World {world} (gloo)", "",
                  "| | step (wall) | step (CPU) | rounds timed | collectives | Newton-Schulz runs per matrix | max "
                  "diff vs unsharded |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for impl in IMPLS:
            r = res["impls"][impl]
            lines.append(f"| {impl} | {_ms(r['step_s'])} | {_ms(r['cpu_s'])} | {r['samples']} | {r['collectives']} | "
                         f"{r['ns_per_matrix']} | {r['max_diff']:.3g} |")
        lines += ["", *goal_lines(res, world), ""]
    sim = muon["simulation"]
    if sim and sim["points"]:
        lines += [f"### Simulated ranks ({sim['model']}, fake process group)", "",
                  "Rank 0 is recorded; the all-ranks total sums every rank's bytes predicted from the layout "
                  "(pure arithmetic), against the analytic `2 x (W-1)/W x matrix bytes` (exact when every "
                  "matrix's rows divide by W). `torch.optim.Muon` runs on the same `Shard(0)` DTensors with meta "
                  "local tensors; its bytes are ring-algorithm bytes (all-gather (W-1) x input, reduce-scatter "
                  "(W-1)/W x input, all-reduce 2 (W-1)/W x input).", "",
                  "| W | matrices | optimizer | collectives per step | bytes sent by rank 0 | rank 0 predicted by the "
                  "layout | all ranks, summed from the layout | analytic 2(W-1)/W x matrix bytes | NS GFLOPs: busiest "
                  "rank, total / W, largest matrix |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in sim["points"]:
            f = p["ns_flops"]
            exact = "equal" if p["predicted_total_bytes"] == p["analytic_all_ranks_bytes"] else "differ"
            lines.append(
                f"| {p['world']} | {p['matrices']} | fully_shard.optim.Muon | {p['collectives_rank0']} ({p['buckets']} "
                f"bucket) | {p['sent_bytes_rank0'] / 2**20:.2f} MiB | {p['expected_sent_bytes_rank0'] / 2**20:.2f} MiB "
                f"| {p['predicted_total_bytes'] / 2**20:.2f} MiB | {p['analytic_all_ranks_bytes'] / 2**20:.2f} MiB "
                f"({exact}) | {f['max_per_rank'] / 1e9:.2f}, {f['ideal_per_rank'] / 1e9:.2f}, "
                f"{f['largest_matrix'] / 1e9:.2f} |"
            )
            t = p.get("torch_muon")
            if t and "error" in t:
                lines.append(f"| {p['world']} | {p['matrices']} | torch.optim.Muon | fails: {t['error'][:160]} | | | | "
                             "| |")
            elif t:
                kinds = ", ".join(f"{n.replace('_into_tensor', '').replace('_tensor', '')} {c}"
                                  for n, c in sorted(t["by_kind"].items()))
                lines.append(
                    f"| {p['world']} | {p['matrices']} | torch.optim.Muon | {t['collectives']} ({kinds}) | "
                    f"{t['sent_bytes_rank0'] / 2**20:.2f} MiB | | | | every rank runs every matrix |"
                )
        lines.append("")
    elif sim:
        lines += [f"Simulation error: {sim['error']}", ""]
    return lines
