"""Smoke test of the benchmark harness: ``python3 -m benchmarks --quick`` writes its report.

No timing assertions: the run succeeds, the Markdown and JSON results hold every section and
key that docs/benchmarks.md describes, and what is exact by construction is equal: the recorded
step's collectives (both libraries) against fully_shard's plan, fully_shard's peak without
activations against the plan's within 1%, Muon's bytes against its layout; the overhead
tables' (world size 1 and 2 ranks) step counts and their four implementations' losses (equal step by step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import die_with_parent

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long
def test_quick_benchmark_writes_markdown_and_json(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), "--machine", "smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,  # under the per-test limit, so the run is killed and its output shown
        preexec_fn=die_with_parent,  # and never outlives a killed test run
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    mds = sorted(out.glob("*-smoke.md"))
    jsons = sorted(out.glob("*-smoke.json"))
    assert len(mds) == 1 and len(jsons) == 1, sorted(p.name for p in out.iterdir())
    assert mds[0].stem == jsons[0].stem

    results = json.loads(jsons[0].read_text())
    assert results["quick"] is True
    for key in ("date", "machine", "cpu", "torch", "commit", "load_before", "shared_note"):
        assert key in results["environment"], key

    assert results["configs"], "no step configuration ran"
    cfg = results["configs"][0]
    assert cfg["error"] is None, cfg["error"]
    res = cfg["result"]
    for impl in ("fully_shard", "torch_fsdp2", "ddp", "unsharded"):
        assert res["step_time"][impl]["median_s"] > 0, impl
    assert {"median", "min", "max", "pairs"} <= set(res["ratio"])
    assert {"fully_shard", "torch_fsdp2", "ddp"} <= set(res["final_loss"])
    plans = cfg["planned"]
    assert len(plans) == 2 and plans[0]["all_gathers"] > 0 and plans[0]["reduce_scatters"] > 0
    for impl in ("fully_shard", "torch_fsdp2"):
        got = res["collectives"][impl]
        assert got["forward"]["all_gather"]["count"] > 0
        assert got["backward"]["reduce_scatter"]["input_bytes"] > 0
        # the recorded step's collectives are those fully_shard issued on the planner's fake process group
        totals = {}
        for kinds in got.values():
            for kind, k in kinds.items():
                n, b = totals.get(kind, (0, 0))
                totals[kind] = (n + k["count"], b + k["input_bytes"])
        assert totals == {"all_gather": (plans[0]["all_gathers"], plans[0]["all_gather_input_bytes"]),
                          "reduce_scatter": (plans[0]["reduce_scatters"],
                                             plans[0]["reduce_scatter_input_bytes"])}, (impl, totals)
    mem = res["memory_per_rank"]
    assert len(mem) == 2
    for rank in range(2):
        # the plan of the same sharding on a fake process group, against the measured peak without activations
        measured = mem[rank]["fully_shard"]["model_state_bytes"]
        assert abs(plans[rank]["peak_bytes"] / measured - 1) <= 0.01, (rank, plans[rank]["peak_bytes"], measured)
    for impl in ("fully_shard", "torch_fsdp2", "ddp"):
        assert mem[0][impl]["peak_bytes"] > 0, impl
        assert {"params", "grads", "optimizer", "other"} <= set(mem[0][impl]["at_peak"])
    assert mem[0]["unsharded"]["peak_bytes"] > 0

    sim = results["simulation"]
    assert sim["points"], "no simulation point"
    for point in sim["points"]:
        assert point["plan"]["peak_bytes"] > point["plan"]["sharded_param_bytes"] > 0, point
        assert point["plan_s"] > 0 and point["apply_s"]["fully_shard"] > 0, point
    by_world = {p["world_size"]: p["plan"] for p in sim["points"]}
    assert by_world[64]["sharded_param_bytes"] < by_world[8]["sharded_param_bytes"]  # 8 times fewer rows each

    muon = results["muon"]
    assert muon["steps"] and muon["steps"][0]["error"] is None, muon["steps"]
    ours = muon["steps"][0]["result"]["impls"]["fully_shard.optim.Muon"]
    assert ours["collectives"] == 2, ours  # one bucket: one all-to-all each way
    assert all(p["sent_bytes_rank0"] == p["expected_sent_bytes_rank0"] for p in muon["simulation"]["points"])
    for p in muon["simulation"]["points"]:
        # every rank's bytes summed from the layout equal 2 (W-1)/W x matrix bytes when the rows
        # divide by W (each owner then holds 1/W of its matrix); exact integer arithmetic
        if p["rows_divide"]:
            assert p["predicted_total_bytes"] == p["analytic_all_ranks_bytes"], p
        assert "collectives" in p["torch_muon"] or "error" in p["torch_muon"], p["torch_muon"]

    overhead = results["overhead"]
    assert overhead["error"] is None, overhead["error"]
    assert overhead["two_ranks"]["error"] is None, overhead["two_ranks"]["error"]
    for world, ovh in ((1, overhead["result"]), (2, overhead["two_ranks"]["result"])):
        _check_overhead(ovh, world)

    md = mds[0].read_text()
    for heading in (
        "## Step time",
        "## Peak memory per rank",
        "## Collectives per step per rank",
        "## Scale simulation",
        "## Targets from the issue",
        "## Muon optimizer step",
        "## Framework overhead at world size 1",
        "### The same on 2 gloo ranks",
        "## Plots",
    ):
        assert heading in md, heading
    assert "fully_shard" in md and "torch FSDP2" in md


def _check_overhead(ovh: dict, world: int) -> None:
    """The overhead table of one world size: counts, the overhead arithmetic and the losses."""
    impls = {"plain", "fully_shard", "fully_shard_local_step", "torch_fsdp2"}
    phases = {"forward", "backward", "clip", "optimizer", "step"}
    assert ovh["world_size"] == world
    assert set(ovh["median_s"]) == impls and ovh["config"]["groups"] == ovh["config"]["n_layers"] + 1
    for impl in impls:
        # every implementation ran every round; the warm-up rounds are not timed
        assert ovh["steps_run"][impl] == len(ovh["losses"][impl]) == ovh["warmup"] + ovh["steps"], (world, impl)
        assert ovh["steps_timed"][impl] == ovh["steps"], (world, impl)
        assert set(ovh["median_s"][impl]) == phases, (world, impl)
        assert all(len(ovh["samples_s"][impl][ph]) == ovh["steps"] for ph in phases), (world, impl)
    for impl in impls - {"plain"}:
        # overhead = median minus the plain model's median, phase by phase (the same float arithmetic)
        for ph in phases:
            assert (ovh["overhead_s"][impl][ph]
                    == ovh["median_s"][impl][ph] - ovh["median_s"]["plain"][ph]), (world, impl, ph)
        assert "hook_per_group" in ovh["overhead_s"][impl], (world, impl)
    assert set(ovh["ratio_to_torch"]) == {"fully_shard", "fully_shard_local_step"}
    # the same weights, batches (on every rank) and arithmetic, and clipping by exactly 1.0, so every
    # step's loss agrees with the plain model's (relative tolerance LOSS_RTOL = 1e-5: the order of some
    # reductions differs; on 2 ranks the average of two equal gradients is exact), and local_step is
    # bitwise the DTensor step
    assert ovh["loss_rtol"] == 1e-5
    assert ovh["losses_agree"] is True, (world, ovh["loss_max_rel_diff_to_plain"])
    for impl in impls - {"plain"}:
        for a, b in zip(ovh["losses"][impl], ovh["losses"]["plain"]):
            assert abs(a - b) <= 1e-5 * abs(b), (world, impl, ovh["losses"][impl], ovh["losses"]["plain"])
    assert ovh["local_step_bitwise_equal"] is True
    assert ovh["losses"]["fully_shard_local_step"] == ovh["losses"]["fully_shard"]
