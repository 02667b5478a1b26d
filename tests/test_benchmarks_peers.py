"""The peers benchmark (``benchmarks/peers.py``, issue 39) on the tiny model, one peer at a time beside fully_shard.

Each peer is optional (the ``peers`` extra): a peer that is not installed is skipped, and the skip names the package.
What must hold where it runs: the peer's and fully_shard's losses over the first steps agree with one unsharded model
stepping on every rank's batch (the same check that gates the benchmark's timing), and both were timed.
"""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.peers import PARITY_STEPS, RTOL, peers_job, summarize
from benchmarks.spawn import run_job

PEERS = {"simple_fsdp": "torchtitan", "zero3": "deepspeed"}


@pytest.mark.long  # a 2-rank spawn with torchtitan's (or DeepSpeed's) import: 54 s on the loaded 2 cores
@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_matches_the_unsharded_model(peer: str) -> None:
    package = PEERS[peer]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: the {peer} peer needs the 'peers' extra (pip install -e '.[peers]')")
    job = {"mp": "fp32", "quick": True, "rounds": 1, "memory": False, "impls": ["fully_shard", peer]}
    res, err, _ = run_job(peers_job, job, nprocs=2, timeout_s=280)
    assert err is None, err
    assert res["errors"] == {}, res["errors"]
    for impl in ("fully_shard", peer):
        p = res["parity"][impl]
        assert len(p["losses"]) == len(p["oracle"]) == PARITY_STEPS
        assert p["ok"] and p["max_rel_diff"] <= RTOL["fp32"], (impl, p)
        assert len(res["samples_s"][impl]) == 1 and res["samples_s"][impl][0] > 0
    (row,) = summarize(res)
    assert (row["ours"], row["peer"]) == ("fully_shard", peer) and row["ratio"] > 0
