"""Loading a checkpoint someone else wrote runs no code (issue 36): every loader of ``fully_shard.ckpt`` reads DCP's
``.metadata`` with an allowlist and every entry with ``torch.load(weights_only=True)``.

Each poisoned checkpoint carries a payload that creates a file when unpickled (``os.system("touch ...")``); torch's own
``dcp.load`` with its default reader runs it (checked here, so the payload is known to be live), ours refuse it with
an error naming the file, and the file is never created. Real checkpoints: the same loaders load those of this torch
(here and in tests/test_ckpt.py: sharded, consolidated, the command line; tests/test_recipes.py: the main job's
``--resume``, bitwise) and those written by torch 2.11 and 2.14.1 (tests/fixtures/dcp, made by
tests/make_dcp_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from fully_shard.ckpt import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    consolidate,
    load_checkpoint,
    load_consolidated,
    read_metadata,
)
from tests.harness import run_distributed
from tests.make_dcp_fixtures import state as _state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "dcp")


class _Touch:
    """Unpickles as ``os.system("touch <path>")``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _template() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0,
            "train": {"losses": [], "flags": {"dim": 0, "tokenizer": "bpe"}}}


def _save(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled ... single process"
        dcp.save(_state(), checkpoint_id=path, no_dist=True)


def _poison_metadata(ckpt: str, marker: str) -> str:
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(_Touch(marker), f)
    return os.path.join(ckpt, ".metadata")


def _poison_entry(ckpt: str, fqn: str, marker: str) -> str:
    """Point the entry ``fqn`` (a tensor's or a non-tensor's) of a real checkpoint at a ``torch.save`` of the payload,
    appended to its data file; the metadata stays DCP's own. Returns the data file."""
    md = read_metadata(os.path.join(ckpt, ".metadata"))
    blob = io.BytesIO()
    torch.save(_Touch(marker), blob)
    (index,) = [k for k in md.storage_data if k.fqn == fqn]
    data = os.path.join(ckpt, md.storage_data[index].relative_path)
    offset = os.path.getsize(data)
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    md.storage_data[index] = _StorageInfo(md.storage_data[index].relative_path, offset, len(blob.getvalue()))
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return data


def _poisoned(tmp_path: Any, where: str) -> tuple[str, str, str]:
    """(checkpoint, the file the error must name, the marker the payload would create)."""
    ckpt, marker = str(tmp_path / "step_7"), str(tmp_path / f"PWNED_{where}")
    if where == "metadata":
        return ckpt, _poison_metadata(ckpt, marker), marker
    _save(ckpt)
    return ckpt, _poison_entry(ckpt, {"bytes": "step", "tensor": "model.w"}[where], marker), marker


def _loads(state: dict[str, Any], expected: dict[str, Any]) -> None:
    assert state["step"] == expected["step"] and state["train"] == expected["train"], state
    for k, v in expected["model"].items():
        # bitwise on any CPU: loading copies the saved bytes
        assert state["model"][k].dtype == v.dtype and torch.equal(state["model"][k], v), k


@pytest.mark.parametrize("where", ["metadata", "bytes", "tensor"])
def test_torch_default_reader_runs_the_payload(tmp_path: Any, where: str) -> None:
    """The witness: the payloads below are live, torch's own dcp.load (its default reader and planner) runs the
    metadata's and the non-tensor entry's (tensor data it already reads with weights_only=True)."""
    ckpt, _, marker = _poisoned(tmp_path, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(_template(), checkpoint_id=ckpt, no_dist=True)
        except BaseException:  # CheckpointException: the payload's result is no Metadata / no int
            pass
    assert os.path.exists(marker) == (where != "tensor"), where


@pytest.mark.parametrize("where", ["metadata", "bytes", "tensor"])
def test_load_checkpoint_and_reader_refuse_and_name_the_file(tmp_path: Any, where: str) -> None:
    ckpt, named, marker = _poisoned(tmp_path, where)
    with pytest.raises(UnsafeCheckpointError, match="refused to load the global 'posix.system'") as refused:
        load_checkpoint(_template(), ckpt, no_dist=True)
    assert str(refused.value).startswith(f"{named}: "), refused.value
    # the reader as torch's dcp.load takes it: DCP wraps the refusal in its CheckpointException
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as wrapped:
        warnings.simplefilter("ignore")
        dcp.load(_template(), storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    if where == "metadata" and _TORCH < (2, 13):  # torch 2.11 drops read_metadata's error: "metadata is None"
        assert "metadata is None" in str(wrapped.value), wrapped.value
    else:
        assert f"{named}: refused to load the global 'posix.system'" in str(wrapped.value), wrapped.value
    assert not os.path.exists(marker)


def test_load_checkpoint_and_reader_load_a_real_checkpoint(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt)
    state = _template()
    load_checkpoint(state, ckpt, no_dist=True)
    _loads(state, _state())
    state = _template()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    _loads(state, _state())


@pytest.mark.parametrize("where", ["metadata", "tensor"])
def test_load_consolidated_consolidate_and_command_refuse(tmp_path: Any, where: str) -> None:
    ckpt, named, marker = _poisoned(tmp_path, where)
    out = str(tmp_path / "model.safetensors")
    for load in (lambda: load_consolidated(ckpt), lambda: consolidate(ckpt, out)):
        with pytest.raises(UnsafeCheckpointError, match="refused to load the global 'posix.system'") as refused:
            load()
        assert str(refused.value).startswith(f"{named}: "), refused.value
    done = subprocess.run([sys.executable, "-m", "fully_shard.ckpt.convert", ckpt, out], capture_output=True,
                          text=True, timeout=120, check=False, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2, (done.stdout, done.stderr)  # argparse's error exit
    assert f"error: {named}: refused to load the global 'posix.system'" in done.stderr, done.stderr
    assert not os.path.exists(marker) and not os.path.exists(out)


def _manager_load(root: str, where: str) -> tuple[str, str]:
    """Returns (the file poisoned, on rank 0; the error's text)."""
    import torch.distributed as dist

    from fully_shard.ckpt import CheckpointManager

    manager = CheckpointManager(root)
    manager.maybe_save(7, _state)
    named, ckpt, marker = "", os.path.join(root, "step_7"), os.path.join(root, "PWNED")
    if dist.get_rank() == 0:
        named = _poison_metadata(ckpt, marker) if where == "metadata" else _poison_entry(ckpt, "step", marker)
    dist.barrier()
    try:
        manager.load_latest(_template())
    except UnsafeCheckpointError as e:
        return named, str(e)
    return named, ""


@pytest.mark.parametrize("where", ["metadata", "bytes"])
def test_manager_load_latest_refuses_on_every_rank(tmp_path: Any, where: str) -> None:
    root = str(tmp_path / "ckpt")
    results = run_distributed(_manager_load, 2, root, where)
    named = results[0][0]
    for _, message in results:
        assert message.startswith(f"{named}: refused to load the global 'posix.system'"), message
    assert not os.path.exists(os.path.join(root, "PWNED"))


def test_main_job_resume_refuses(tmp_path: Any) -> None:
    ckpt_dir = tmp_path / "ckpt"
    named = _poison_metadata(str(ckpt_dir / "step_3"), str(tmp_path / "PWNED"))
    args = ["--device", "cpu", "--nproc", "1", "--n-layers", "1", "--dim", "16", "--n-heads", "2", "--seq-len", "8",
            "--batch-size", "2", "--vocab-size", "300", "--steps", "4", "--ckpt-dir", str(ckpt_dir), "--resume",
            "--no-plot"]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode != 0, done.stdout
    assert f"{named}: refused to load the global 'posix.system'" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "PWNED")


def test_allowlist_refuses_what_dcp_metadata_never_holds(tmp_path: Any) -> None:
    """Beyond a refused global: an allowed class used to set state on a class, or called in ways DCP never does."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = str(tmp_path / ".metadata")
    # BUILD with slot state on the class Metadata itself (would set Metadata.version on the class)
    payload = (pickle.PROTO + b"\x04" + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"
               + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x07version" + pickle.SHORT_BINUNICODE
               + b"\x01x" + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    with open(path, "wb") as f:
        f.write(payload)
    with pytest.raises(UnsafeCheckpointError, match="refused to set the state of a type"):
        read_metadata(path)
    assert not hasattr(Metadata, "version") or Metadata.version != "x"
    with open(path, "wb") as f:
        pickle.dump({"not": "metadata"}, f)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: holds a dict, not DCP's Metadata"):
        read_metadata(path)


@dataclasses.dataclass
class _PlannerData:
    steps: int


def test_extra_globals_allow_a_class_of_your_own(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    path = str(tmp_path / ".metadata")
    with open(path, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}, planner_data=_PlannerData(3)), f)
    with pytest.raises(UnsafeCheckpointError, match="refused to load the global 'tests.test_ckpt_safety._PlannerData'"):
        read_metadata(path)
    assert read_metadata(path, extra_globals=[_PlannerData]).planner_data == _PlannerData(3)


@pytest.mark.parametrize("version", ["2.11.0", "2.14.1"])
def test_checkpoints_of_other_torch_versions_load(version: str) -> None:
    """tests/make_dcp_fixtures.py wrote these with that torch: DCP's metadata classes of each version load through
    the allowlist, and the values are those it saved."""
    ckpt = os.path.join(FIXTURES, f"torch-{version}")
    if not os.path.isdir(ckpt):
        pytest.fail(f"{ckpt} is missing: run tests/make_dcp_fixtures.py with torch {version}")
    with open(os.path.join(ckpt, "version.txt")) as f:
        assert f.read().strip().startswith(version)
    state = _template()
    load_checkpoint(state, ckpt, no_dist=True)
    _loads(state, _state())
    sd = load_consolidated(ckpt)
    assert sorted(sd) == ["b", "w"] and torch.equal(sd["w"], _state()["model"]["w"])
