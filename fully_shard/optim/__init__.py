"""Optimizers for sharded parameters.

``Muon`` orthogonalizes each weight matrix once, on one owner rank, and matches
``torch.optim.Muon`` on the unsharded model; ``MuonAdamW`` and ``muon_param_groups`` make
the usual Muon + AdamW recipe one optimizer; ``owned_matrices`` is the owner machinery for
other matrix optimizers; ``local_step`` runs an elementwise optimizer (AdamW, SGD, ...) on the
DTensors' local tensors, at plain-tensor speed; ``in_backward`` steps one optimizer per
parameter inside backward. See docs/optimizers.md.
"""

from .backward import InBackward, in_backward
from .local import ELEMENTWISE_OPTIMIZERS, local_step
from .muon import Muon, newton_schulz
from .muon_adamw import MuonAdamW, muon_param_groups
from .owned import MatrixLayout, assign_owners, matrix_layout, newton_schulz_flops, owned_matrices

__all__ = [
    "Muon",
    "MuonAdamW",
    "muon_param_groups",
    "newton_schulz",
    "owned_matrices",
    "matrix_layout",
    "MatrixLayout",
    "assign_owners",
    "newton_schulz_flops",
    "local_step",
    "in_backward",
    "InBackward",
    "ELEMENTWISE_OPTIMIZERS",
]
