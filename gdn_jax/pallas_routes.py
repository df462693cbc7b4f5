"""Adapts ``pallas_kernels`` to the ``gdn_jax`` op signatures and registers them in
:data:`gdn_jax.dispatch.PALLAS_OPS` on import.

The kernels apply the q/k l2norm and scale themselves (the same formula as
:func:`gdn_jax._prep.prepare_qk`), so raw q/k go straight in without an extra pass over HBM. On a
CPU backend the kernels run in interpret mode, so ``impl="pallas"`` works (slowly) everywhere.

Registered: ``tree_verify`` and ``tree_commit``. ``"auto"`` takes them on GPU for trees of at
most ``pallas_kernels.GPU_MAX_NODES`` nodes (a larger tile exceeds shared memory) with power-of-2
head dims, where the H200 measurements show them faster than XLA; bf16 inputs run the verify's
dots as bf16x3 (3 bf16 MMAs, f32 accumulation: measured 1.2-3.9x faster than XLA, relative error
1.6e-4 against the f32 XLA path), f32 inputs as tf32x3 (f32-level accuracy). The chunked prefill
kernel is not registered: on the H200 it builds only for chunks of at most 32 tokens and runs
about 8x slower than flash-linear-attention (benchmarks/README.md), so ``"auto"`` keeps the XLA
path; call :func:`pallas_kernels.chunk_gated_delta_rule` directly to use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from gdn_jax.dispatch import AUTO_PALLAS, PALLAS_OPS
from gdn_jax.tree_wy import TreeCache


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _fits_gpu_kernel(q, k, v) -> bool:
    n, dk, dv = k.shape[1], k.shape[3], v.shape[3]
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0
    return n <= pallas_kernels.GPU_MAX_NODES and pow2(dk) and pow2(dv)


def tree_verify(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """``(o, u, g_path)`` of the tree WY verify (see :func:`gdn_jax.tree_verify`)."""
    interpret = _interpret()
    low = q.dtype == k.dtype == v.dtype == jnp.bfloat16
    blocks = pallas_kernels.VerifyBlocks(precision="bf16x3" if low and not interpret else "tf32x3")
    # (default mode "refine": one-pass dots, bf16 approximate inverse, two refinement steps)
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
        blocks=blocks,
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
# "auto" takes the kernels where they were measured faster than XLA on the H200
# (benchmarks/README.md); the commit kernel is slower than XLA at N = 128.
AUTO_PALLAS.update(
    tree_verify=_fits_gpu_kernel,
    tree_commit=lambda cache: _fits_gpu_kernel(cache.k, cache.k, cache.u),
)
