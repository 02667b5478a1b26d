"""Write the tiny DCP checkpoint of tests/fixtures/dcp/torch-<version>/ with the torch this runs on (a few KB), for
tests/test_ckpt_safety.py: checkpoints of other torch versions load through fully_shard.ckpt's allowlist.

    /work/venvs/t211/bin/python tests/make_dcp_fixtures.py     # torch 2.11.0
    /work/venvs/t2141/bin/python tests/make_dcp_fixtures.py    # torch 2.14.1

Needs torch only (not fully_shard), so it runs in a venv that has nothing else.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "dcp")


def state() -> dict[str, Any]:
    """What the fixture holds: tensors of two dtypes and non-tensor entries (DCP's bytes items)."""
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3, dtype=torch.bfloat16)},
            "step": 7, "train": {"losses": [2.5, 2.25], "flags": {"dim": 32, "tokenizer": None}}}


def main() -> int:
    version = torch.__version__.split("+")[0]
    out = os.path.join(FIXTURES, f"torch-{version}")
    shutil.rmtree(out, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state(), checkpoint_id=out, no_dist=True)
    with open(os.path.join(out, "version.txt"), "w") as f:
        f.write(torch.__version__ + "\n")
    print(f"wrote {out}: {sorted(os.listdir(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
