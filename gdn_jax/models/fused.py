"""Fused input projections: the matmuls of a block that read the same input run as one.

A Gated DeltaNet layer projects its normed input four times (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), a gated attention layer three times (``q_proj``, ``k_proj``,
``v_proj``), a SwiGLU MLP twice (``gate_proj``, ``up_proj``) and a sparse MoE block four times
(the router, the shared expert's gate and up projections and its sigmoid gate). At decode
sizes each projection is its own GPU kernel that reads a few MB of weights; stacked into one
``[sum of outputs, in]`` weight they are one kernel per block, and one weight array instead of
several for every step's call (vLLM's merged QKV and gate-up layers).

:func:`fuse_projections` rewrites a model in place (the serving engine does it on its own view
of the model, :class:`serving.LLM`): each fused block gets a :class:`FusedLinear` named
``fused_in`` and its separate projections become ``None``. The block's outputs are those of
the separate projections up to the summation order of one matmul. Checkpoints are written from
unfused models (:func:`serving.checkpoint.save_pretrained` refuses a fused one), and blocks
split over devices (tensor or expert parallel) stay unfused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models.linear import matmul_precision


class FusedLinear(nnx.Module):
    """``x W^T`` for ``W = concat(weights)`` (each ``[out_i, in]``, HF layout, one dtype),
    returned split back into the parts' outputs ``[..., out_i]``."""

    def __init__(self, weights: list[jax.Array]):
        if not weights or len({(w.shape[1], w.dtype) for w in weights}) != 1:
            raise ValueError(
                "weights: need one or more [out, in] matrices of one input size and dtype, got "
                f"{[(w.shape, str(w.dtype)) for w in weights]}"
            )
        self.sizes = tuple(int(w.shape[0]) for w in weights)
        self.weight = nnx.Param(jnp.concatenate(weights, axis=0))

    @property
    def columns(self) -> tuple[int, ...]:
        """The column where each part's outputs start in :meth:`matmul`'s output."""
        return tuple(int(c) for c in np.cumsum((0, *self.sizes[:-1])))

    def matmul(self, x: jax.Array) -> jax.Array:
        """``x W^T``, the parts' outputs side by side ``[..., sum(out_i)]`` (a kernel that
        reads its columns in place needs no copy of a slice)."""
        w = self.weight[...]
        return jnp.einsum(
            "...i,oi->...o", x.astype(w.dtype), w, precision=matmul_precision(w.dtype)
        )

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        """:meth:`matmul`'s output split into the parts' outputs."""
        return tuple(jnp.split(y, self.columns[1:], axis=-1))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        return self.split(self.matmul(x))


def _fuse(module: nnx.Module, names: list[str], owners: list[nnx.Module] | None = None) -> None:
    """Replaces the ``Linear`` projections ``names`` (attributes of ``owners[i]``, default
    ``module``) by ``module.fused_in``, in that order."""
    owners = owners or [module] * len(names)
    weights = [getattr(o, n).weight[...] for o, n in zip(owners, names, strict=True)]
    module.fused_in = FusedLinear(weights)
    for o, n in zip(owners, names, strict=True):
        setattr(o, n, None)


def fuse_projections(model: nnx.Module) -> int:
    """Fuses, in place, the input projections of every block of ``model`` (the MTP head's
    included) that reads one input several times: returns how many blocks it fused. Blocks
    already fused, GDN layers whose channels are split over devices and MoE blocks run
    tensor- or expert-parallel are left as they are."""
    from gdn_jax.models.attention import Attention
    from gdn_jax.models.gdn import GatedDeltaNet
    from gdn_jax.models.mlp import MLP
    from gdn_jax.models.moe import SparseMoE

    modules = [m for _, m in nnx.iter_graph(model)]
    # an MoE block's shared expert is fused with its block (or, split over devices, not)
    shared = {id(m.shared_expert) for m in modules if isinstance(m, SparseMoE)}
    fused = 0
    for m in modules:
        if getattr(m, "fused_in", None) is not None:
            continue
        if isinstance(m, GatedDeltaNet) and m.qkv_groups == 1:
            _fuse(m, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
        elif isinstance(m, Attention):
            _fuse(m, ["q_proj", "k_proj", "v_proj"])
        elif isinstance(m, SparseMoE) and m.parallel is None:
            se = m.shared_expert
            _fuse(m, ["gate", "gate_proj", "up_proj", "shared_expert_gate"], [m, se, se, m])
        elif isinstance(m, MLP) and id(m) not in shared:
            _fuse(m, ["gate_proj", "up_proj"])
        else:
            continue
        fused += 1
    return fused


def is_fused(model: nnx.Module) -> bool:
    """Whether any block of ``model`` runs fused projections (:func:`fuse_projections`)."""
    return any(isinstance(m, FusedLinear) for _, m in nnx.iter_graph(model))
