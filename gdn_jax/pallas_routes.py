"""Adapts ``pallas_kernels`` to the ``gdn_jax`` op signatures and registers them in
:data:`gdn_jax.dispatch.PALLAS_OPS` on import.

The kernels apply the q/k l2norm and scale themselves (the same formula as
:func:`gdn_jax._prep.prepare_qk`), so raw q/k go straight in without an extra pass over HBM. On a
CPU backend the kernels run in interpret mode, so ``impl="pallas"`` works (slowly) everywhere.

Registered: ``tree_verify`` (trees above ``pallas_kernels.GPU_MAX_NODES`` nodes take the XLA path
on GPU, where the kernel's tile exceeds shared memory) and ``tree_commit``. The chunked prefill
kernel is not registered: on the H200 it builds only for chunks of at most 32 tokens and runs
about 8x slower than flash-linear-attention (benchmarks/README.md), so ``"auto"`` keeps the XLA
path; call :func:`pallas_kernels.chunk_gated_delta_rule` directly to use it.
"""

from __future__ import annotations

import jax

import pallas_kernels
from gdn_jax.dispatch import AUTO_PALLAS, PALLAS_OPS
from gdn_jax.tree_wy import TreeCache


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def tree_verify(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """``(o, u, g_path)`` of the tree WY verify (see :func:`gdn_jax.tree_verify`)."""
    interpret = _interpret()
    return pallas_kernels.tree_verify(
        q,
        k,
        v,
        g,
        beta,
        parents,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        interpret=interpret,
    )


def tree_commit(initial_state, cache: TreeCache, path, path_len):
    """The committed state (see :func:`gdn_jax.tree_commit`); ``initial_state`` is aliased."""
    return pallas_kernels.tree_commit(
        initial_state,
        cache.k,
        cache.u,
        cache.g_path,
        path,
        path_len,
        use_qk_l2norm=cache.qk_l2norm,
        interpret=_interpret(),
    )


PALLAS_OPS.update(tree_verify=tree_verify, tree_commit=tree_commit)
# "auto" takes only the kernels measured faster than XLA on the H200 (benchmarks/README.md):
# the verify kernel is still 2.6x slower than XLA at B >= 16, so auto keeps XLA for it.
AUTO_PALLAS.add("tree_commit")
