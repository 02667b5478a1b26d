"""User misuse: each raises a clear error (type and message) instead of a confusing one or
silently wrong training. Also the remedies the messages recommend must work.

Cases run on a 1-rank pool (cheapest) unless the misuse needs several ranks; the errors that
name a module or parameter by its name in the model run on 2 ranks, as users meet them. Each case is
a module-level function run by :func:`_catching`, which returns the exception it raised.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fully_shard
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn

ARGS = ModelArgs(n_layers=2)

# ---------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------


def _catching(case: Callable[..., Any], *args: Any) -> tuple[type[BaseException], str] | None:
    """Run ``case``; return (exception type, message) if it raised, else None."""
    try:
        case(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc), str(exc)
    return None


def _expect_error(
    case: Callable[..., Any], exc_type: type[BaseException], *fragments: str, args: tuple[Any, ...] = (),
    world_size: int = 1
) -> str:
    results = run_distributed(_catching, world_size, case, *args)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank}: {case.__name__} raised nothing; expected {exc_type.__name__}"
        typ, msg = res
        assert issubclass(typ, exc_type), f"rank {rank}: expected {exc_type.__name__}, got {typ.__name__}: {msg}"
        for fragment in fragments:
            assert fragment in msg, f"rank {rank}: {fragment!r} not in the message: {msg}"
    return results[0][1]


def _expect_ok(case: Callable[..., Any], *args: Any, world_size: int = 1) -> None:
    results = run_distributed(_catching, world_size, case, *args)
    for rank, res in enumerate(results):
        assert res is None, f"rank {rank}: {case.__name__} raised {res[0].__name__}: {res[1]}"


def _fully_shard(*args: Any, **kwargs: Any) -> Any:
    from fully_shard import fully_shard

    return fully_shard(*args, **kwargs)


def _mesh(*shape: int) -> Any:
    return init_device_mesh(device_type(), shape)


def _shard_nested(model: Transformer) -> Transformer:
    for block in model.layers:
        _fully_shard(block)
    _fully_shard(model)
    return model


# ---------------------------------------------------------------------------
# Cases (run on the workers)
# ---------------------------------------------------------------------------


def _case_mesh_3d() -> None:
    _fully_shard(nn.Linear(4, 4), mesh=_mesh(1, 1, 1))


def _case_mesh_2d_model_parallel_names() -> None:
    mesh = init_device_mesh(device_type(), (1, 1), mesh_dim_names=("dp", "tp"))
    _fully_shard(nn.Linear(4, 4), mesh=mesh)


def _case_mesh_not_a_mesh() -> None:
    _fully_shard(nn.Linear(4, 4), mesh="cpu")


def _case_meta_submodule_at_first_forward() -> None:
    model = Transformer(ARGS)
    model.layers[0].attention.wq = nn.Linear(ARGS.dim, ARGS.dim, bias=False, device="meta")
    _shard_nested(model)
    model(batch(0, 0))


def _case_meta_model_forward_without_to_empty() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    _shard_nested(model)
    model(batch(0, 0))


def _case_meta_init_then_to_empty() -> None:
    """The remedy the meta-device message recommends: to_empty, initialise, train."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = Transformer(ARGS)
    with torch.device("meta"):
        model = Transformer(ARGS)
    _shard_nested(model)
    model.to_empty(device=device_type())
    model.pos = ref.pos.clone()  # a non-persistent buffer: to_empty leaves it uninitialised
    with torch.no_grad():
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            chunks = torch.chunk(p_ref, world, dim=0)
            if rank < len(chunks):
                p.to_local().copy_(chunks[rank])
    x = batch(0, rank)
    # bitwise on any CPU: forward only, the same kernels on the same (copied) full weights
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def _case_to_float64_after_fully_shard() -> None:
    """torch's FSDP2 supports casting after fully_shard (``model.double()``)."""
    ref = Transformer(ARGS)
    model = _shard_nested(copy.deepcopy(ref))
    model.double()
    ref.double()
    x = batch(0, dist.get_rank())
    loss = loss_fn(model(x), x)
    loss.backward()
    assert loss.dtype == torch.float64, loss.dtype
    torch.testing.assert_close(loss, loss_fn(ref(x), x))
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 and p.grad.dtype == torch.float64, name


def _case_deepcopy() -> None:
    model = _shard_nested(Transformer(ARGS))
    copy.deepcopy(model)


def _case_deepcopy_blocks_only() -> None:
    model = Transformer(ARGS)
    for block in model.layers:
        _fully_shard(block)
    copy.deepcopy(model)


def _case_fully_shard_twice() -> None:
    block = Transformer(ARGS).layers[0]
    _fully_shard(block)
    _fully_shard(block)


def _case_top_down() -> None:
    model = Transformer(ARGS)
    _fully_shard(model)
    _fully_shard(model.layers[0])


# A parameter tied across calls trains (tests/test_tied.py) when the calls shard it alike; the cases below differ
def _case_parameter_tied_across_groups() -> None:
    from torch.distributed.tensor import Shard

    model = Transformer(ARGS)
    model.layers[1].attention.wq.weight = model.layers[0].attention.wq.weight
    _fully_shard(model.layers[0])
    _fully_shard(model.layers[1], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)


def _case_module_shared_across_groups() -> None:
    model = Transformer(ARGS)
    model.layers[1].attention.wq = model.layers[0].attention.wq  # one Linear in two blocks
    _fully_shard(model.layers[0])
    _fully_shard(model.layers[1], offload_policy=fully_shard.CPUOffloadPolicy(pin_memory=False))


def _case_tied_mixed_precision() -> None:
    model = Transformer(ARGS)
    model.layers[1].attention.wq.weight = model.layers[0].attention.wq.weight
    _fully_shard(model.layers[0])
    _fully_shard(model.layers[1], mp_policy=fully_shard.MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def _case_tied_root_and_block() -> None:
    model = Transformer(ModelArgs(n_layers=2, vocab_size=100))
    model.output.weight = model.layers[0].attention.wq.weight  # (100, 100) both
    for block in model.layers:
        _fully_shard(block)
    _fully_shard(model, mesh=_mesh(1, dist.get_world_size()))  # HSDP over one replica


def _case_tied_grouped_calls() -> None:
    from torch.distributed.tensor import Shard

    model = Transformer(ARGS)
    model.output.weight = model.tok_embeddings.weight
    _fully_shard([model.norm, model.output], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    _fully_shard([model.layers[0], model.tok_embeddings])


def _case_tied_no_model() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    _fully_shard(a)
    _fully_shard(b, offload_policy=fully_shard.CPUOffloadPolicy(pin_memory=False))


def _case_module_list() -> None:
    _fully_shard(Transformer(ARGS).layers)


def _case_mp_policy_wrong_type() -> None:
    _fully_shard(nn.Linear(4, 4), mp_policy=torch.bfloat16)


def _case_offload_policy_wrong_type() -> None:
    _fully_shard(nn.Linear(4, 4), offload_policy="cpu")


def _case_shard_placement_fn() -> None:
    from torch.distributed.tensor import Replicate

    _fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate())


def _case_reshard_after_forward_int() -> None:
    _fully_shard(nn.Linear(4, 4), reshard_after_forward=2)  # 1 rank: no 2-rank subgroup


def _case_reshard_after_forward_bad(value: Any) -> None:
    _fully_shard(nn.Linear(4, 4), reshard_after_forward=value)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _case_scalar_parameter() -> None:
    _fully_shard(_Scaled())


def _case_scalar_parameter_ignored() -> None:
    """The remedy the scalar message recommends."""
    m = _Scaled()
    _fully_shard(m, ignored_params={m.scale})
    m(torch.randn(2, 4)).sum().backward()
    assert m.scale.grad is not None and not hasattr(m.scale, "placements")
    assert m.lin.weight.grad is not None


def _case_child_forward_before_root() -> None:
    model = _shard_nested(Transformer(ARGS))
    model.layers[0](torch.randn(2, ARGS.max_seq_len, ARGS.dim))
    model(batch(0, 0))


def _case_forward_prefetch_non_fsdp() -> None:
    model = _shard_nested(Transformer(ARGS))
    model.layers[0].set_modules_to_forward_prefetch([model.norm])


def _case_backward_prefetch_non_fsdp() -> None:
    model = _shard_nested(Transformer(ARGS))
    model.layers[1].set_modules_to_backward_prefetch([model.layers[0].attention])


def _case_reset_iter_state_non_root() -> None:
    model = _shard_nested(Transformer(ARGS))
    x = batch(0, 0)
    loss_fn(model(x), x).backward()
    model.layers[0].reset_iter_state()


def _case_reset_iter_state_root_before_forward() -> None:
    """E.g. the data loader raised in the first iteration, before any forward: resetting
    the root has nothing to undo and must not claim it is not the root; the first step
    then is the step of a model that was never reset."""
    torch.manual_seed(0)
    model = _shard_nested(Transformer(ARGS))
    model.reset_iter_state()
    torch.manual_seed(0)
    never_reset = _shard_nested(Transformer(ARGS))
    x = batch(0, 0)
    losses = []
    for m in (model, never_reset):
        loss = loss_fn(m(x), x)
        loss.backward()
        losses.append(loss)
    # bitwise on any CPU: the same model and batch on one rank, the same arithmetic
    assert torch.equal(losses[0], losses[1]), losses
    for (name, p), q in zip(model.named_parameters(), never_reset.parameters()):
        assert p.grad is not None and torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


def _case_setter_bad_values(which: str) -> None:
    model = _shard_nested(Transformer(ARGS))
    if which == "divide_factor":
        model.set_gradient_divide_factor(0.0)
    elif which == "reshard_after_forward":
        model.set_reshard_after_forward(1)  # type: ignore[arg-type]
    elif which == "forward_method":
        from fully_shard import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")


def _case_no_modules() -> None:
    _fully_shard([])


# ---------------------------------------------------------------------------
# Tests: meshes and arguments
# ---------------------------------------------------------------------------


def test_3d_mesh() -> None:
    _expect_error(_case_mesh_3d, ValueError, "3-D mesh", "1-D mesh")


def test_2d_mesh_with_a_model_parallel_dim() -> None:
    # a 2-D mesh is read as HSDP (replicate, shard); a (dp, tp) mesh is a mistake
    _expect_error(_case_mesh_2d_model_parallel_names, ValueError, "HSDP", "'tp'", "mesh['dp']")


def test_mesh_not_a_device_mesh() -> None:
    _expect_error(_case_mesh_not_a_mesh, ValueError, "DeviceMesh", "str")


def test_module_list_passed_directly() -> None:
    _expect_error(_case_module_list, ValueError, "ModuleList")


def test_no_modules() -> None:
    _expect_error(_case_no_modules, ValueError, "at least one module")


def test_mp_policy_wrong_type() -> None:
    # (mixed precision itself is supported; see test_mixed_precision.py)
    _expect_error(_case_mp_policy_wrong_type, ValueError, "MixedPrecisionPolicy")


def test_offload_policy_wrong_type() -> None:
    _expect_error(_case_offload_policy_wrong_type, ValueError, "OffloadPolicy")


def test_shard_placement_fn_must_return_shard() -> None:
    _expect_error(
        _case_shard_placement_fn, ValueError,
        "shard_placement_fn must return Shard(dim), a ShardPlacementResult or None", "weight"
    )


def test_int_reshard_after_forward_not_a_divisor() -> None:
    _expect_error(_case_reshard_after_forward_int, ValueError, "reshard_after_forward=2", "divisor")


@pytest.mark.parametrize("value", ["yes", 1.0])
def test_bad_reshard_after_forward_type(value: Any) -> None:
    _expect_error(_case_reshard_after_forward_bad, ValueError, "reshard_after_forward", repr(value), args=(value,))


@pytest.mark.parametrize(
    "which, fragment",
    [
        ("divide_factor", "gradient divide factor must be positive"),
        ("reshard_after_forward", "reshard_after_forward must be a bool"),
        ("forward_method", "'generate'"),
    ],
)
def test_setter_bad_values(which: str, fragment: str) -> None:
    _expect_error(_case_setter_bad_values, ValueError, fragment, args=(which,))


def test_scalar_parameter() -> None:
    _expect_error(_case_scalar_parameter, ValueError, "'scale'", "scalar", "ignored_params", world_size=2)


def test_scalar_parameter_ignored_params_remedy() -> None:
    _expect_ok(_case_scalar_parameter_ignored)


# ---------------------------------------------------------------------------
# Tests: meta device
# ---------------------------------------------------------------------------


def test_meta_parameter_at_first_forward_names_fqn_from_root() -> None:
    _expect_error(
        _case_meta_submodule_at_first_forward, RuntimeError, "'layers.0.attention.wq.weight'", "meta", "to_empty",
        world_size=2
    )


def test_meta_model_forward_without_to_empty() -> None:
    msg = _expect_error(_case_meta_model_forward_without_to_empty, RuntimeError, "meta", "to_empty", world_size=2)
    named = re.search(r"parameter '([^']+)'", msg)
    assert named is not None, msg
    assert named.group(1) in {n for n, _ in Transformer(ARGS).named_parameters()}, msg


def test_meta_init_then_to_empty_remedy_works() -> None:
    _expect_ok(_case_meta_init_then_to_empty)


def test_cast_to_float64_after_fully_shard() -> None:
    _expect_ok(_case_to_float64_after_fully_shard)


# ---------------------------------------------------------------------------
# Tests: wrapping order, ties, copies
# ---------------------------------------------------------------------------


def test_deepcopy_of_sharded_model() -> None:
    _expect_error(_case_deepcopy, RuntimeError, "deepcopy", "before calling fully_shard")
    _expect_error(_case_deepcopy, AssertionError, "deepcopy")  # torch FSDP2's type, too
    _expect_error(_case_deepcopy, fully_shard.ShardedDeepcopyError, "deepcopy")  # exported: users can catch it


def test_deepcopy_of_model_with_sharded_blocks() -> None:
    _expect_error(_case_deepcopy_blocks_only, RuntimeError, "deepcopy")


def test_fully_shard_twice_on_one_module() -> None:
    _expect_error(_case_fully_shard_twice, ValueError, "already", "once")
    _expect_error(_case_fully_shard_twice, AssertionError, "already")  # torch FSDP2's type, too
    _expect_error(_case_fully_shard_twice, fully_shard.ShardedUsageError, "already")  # exported: users can catch it


def test_top_down_application_says_bottom_up() -> None:
    _expect_error(_case_top_down, ValueError, "'attention_norm.weight'", "bottom-up", world_size=2)


# A tie across calls that shard the parameter differently: both calls by their modules' names in the model, each
# parameter by its name in the model (found from the outermost module that holds both calls' modules), the difference.
_TIED_BLOCKS = (
    "fully_shard(layers.1 (Block)): parameter 'layers.1.attention.wq.weight' is tied to (or shared with) "
    "parameter 'layers.0.attention.wq.weight', which the fully_shard call on layers.0 (Block) sharded differently"
)


def test_parameter_tied_across_groups_sharded_differently() -> None:
    _expect_error(_case_parameter_tied_across_groups, ValueError, _TIED_BLOCKS,
                  "(shard dim (shard_placement_fn): Shard(1) here, Shard(0) there)", "shard it alike", world_size=2)


def test_tie_across_calls_with_different_mixed_precision_is_refused() -> None:
    # both calls sum into one gradient held between them: a bf16 and an fp32 group would mix dtypes silently
    _expect_error(_case_tied_mixed_precision, ValueError, _TIED_BLOCKS,
                  "(mp_policy: param_dtype torch.bfloat16, reduce_dtype torch.bfloat16 here, param_dtype "
                  "torch.float32, reduce_dtype torch.float32 "
                  "there)", "offload_policy and mp_policy to both calls", world_size=2)


def test_module_shared_across_groups_is_a_tie_not_top_down() -> None:
    # block 1 is not inside block 0: the message must not blame the wrapping order
    msg = _expect_error(_case_module_shared_across_groups, ValueError, _TIED_BLOCKS,
                        "(offload policy: CPUOffloadPolicy here, no offload there)", world_size=2)
    assert "bottom-up" not in msg, msg


def test_parameter_tied_between_block_and_root_on_another_mesh() -> None:
    _expect_error(
        _case_tied_root_and_block, ValueError,
        "fully_shard(Transformer): parameter 'output.weight' is tied to (or shared with) parameter "
        "'layers.0.attention.wq.weight', which the fully_shard call on layers.0 (Block) sharded differently "
        "(mesh: a mesh of shape (1, 2) here, a mesh of shape (2,) there)",
        "pass the same mesh", world_size=2,
    )


def test_parameter_tied_between_grouped_calls_sharded_differently() -> None:
    _expect_error(
        _case_tied_grouped_calls, ValueError,
        "fully_shard([layers.0 (Block), tok_embeddings (Embedding)]): parameter 'tok_embeddings.weight' is tied "
        "to (or shared with) parameter 'output.weight', which the fully_shard call on [norm (RMSNorm), output "
        "(Linear)] sharded differently (shard dim (shard_placement_fn): Shard(0) here, Shard(1) there)",
        world_size=2,
    )


def test_parameter_tied_outside_any_model_names_the_classes() -> None:
    # no module holds both: the calls by their classes, the parameters by their local names
    _expect_error(
        _case_tied_no_model, ValueError,
        "fully_shard(Linear): parameter 'weight' is tied to (or shared with) parameter 'weight', which "
        "the fully_shard call on Linear sharded differently", world_size=2,
    )


# ---------------------------------------------------------------------------
# Tests: runtime control
# ---------------------------------------------------------------------------


def test_child_forward_before_root() -> None:
    _expect_error(_case_child_forward_before_root, RuntimeError, "'layers.0'", "root", world_size=2)


def test_forward_prefetch_with_non_fsdp_module() -> None:
    _expect_error(_case_forward_prefetch_non_fsdp, ValueError, "set_modules_to_forward_prefetch", "'norm' (RMSNorm",
                  world_size=2)


def test_backward_prefetch_with_non_fsdp_module() -> None:
    _expect_error(
        _case_backward_prefetch_non_fsdp, ValueError, "set_modules_to_backward_prefetch",
        "'layers.0.attention' (Attention", world_size=2
    )


def test_reset_iter_state_on_non_root() -> None:
    _expect_error(_case_reset_iter_state_non_root, RuntimeError, "reset_iter_state", "root")


def test_reset_iter_state_on_root_before_first_forward() -> None:
    _expect_ok(_case_reset_iter_state_root_before_forward)
