"""Adapts the Mosaic TPU kernels of ``pallas_kernels.tpu`` to the ``gdn_jax`` op signatures and
registers them in :data:`gdn_jax.dispatch.TPU_OPS` (``impl="pallas_tpu"``) on import.

Registered: ``tree_verify``, ``tree_commit``, ``chunk_gated_delta_rule`` (one kernel per
sequence and head group, chunks of ``chunk_size`` in ``pallas_kernels.tpu.chunk.CHUNK_SIZES``),
``recurrent_gated_delta_rule`` (the decode kernel: a token loop on the state in VMEM) and
``routed_experts`` (jax's megablox ``gmm``). Off a TPU backend the kernels run in TPU interpret
mode, so ``impl="pallas_tpu"`` works (slowly) everywhere.

``"auto"`` on a TPU takes the four GDN kernels for every call they accept (nodes, head dims,
chunk size): there is no TPU here to measure them against XLA, so the choice follows the cost
model of ``benchmarks/tpu_roofline.py`` rather than timings. It leaves the MoE on XLA, whose
``ragged_dot`` the TPU compiler lowers natively; ``"pallas_tpu"`` selects ``gmm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.dispatch import AUTO_TPU, TPU_OPS
from gdn_jax.tree_wy import TreeCache
from pallas_kernels import tpu as tpu_kernels
from pallas_kernels.tpu.chunk import CHUNK_SIZES


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def _head_dim(d: int) -> bool:
    """A head dim the TPU kernels take: a multiple of 8 in [8, 256]."""
    return 8 <= d <= 256 and d % 8 == 0


def _fits(k, v, n: int | None = None) -> bool:
    nodes = n is None or n <= tpu_kernels.MAX_NODES
    return nodes and _head_dim(k.shape[-1]) and _head_dim(v.shape[-1])


def tree_verify(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """``(o, u, g_path)`` of the tree WY verify (see :func:`gdn_jax.tree_verify`)."""
    return tpu_kernels.tree_verify(
        q,
        k,
        v,
        g,
        beta,
        parents,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        interpret=_interpret(),
    )


def tree_commit(initial_state, cache: TreeCache, path, path_len):
    """The committed state (see :func:`gdn_jax.tree_commit`); ``initial_state`` is aliased."""
    return cache.commit_with(
        tpu_kernels.tree_commit, initial_state, path, path_len, interpret=_interpret()
    )


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **options):
    """``(o, final state)`` of the chunked prefill (see :func:`gdn_jax.chunk_gated_delta_rule`;
    ``options``: ``scale``, ``use_qk_l2norm``, ``output_final_state``, ``chunk_size``,
    ``cu_seqlens``)."""
    return tpu_kernels.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state, interpret=_interpret(), **options
    )


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, *, scale, use_qk_l2norm):
    """``(o, final state)`` token by token (see :func:`gdn_jax.recurrent_gated_delta_rule`)."""
    if initial_state is None:
        b, hv, dk, dv = k.shape[0], v.shape[2], k.shape[3], v.shape[3]
        initial_state = jnp.zeros((b, hv, dk, dv), jnp.float32)
    return tpu_kernels.recurrent(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        interpret=_interpret(),
    )


def routed_experts(x, weights, experts, gate_proj, up_proj, down_proj):
    """``out [M, H]`` of the routed experts through megablox ``gmm`` (see
    :func:`gdn_jax.routed_experts`)."""
    return tpu_kernels.routed_experts_gmm(
        x, weights, experts, gate_proj, up_proj, down_proj, interpret=_interpret()
    )


TPU_OPS.update(
    tree_verify=tree_verify,
    tree_commit=tree_commit,
    chunk_gated_delta_rule=chunk_gated_delta_rule,
    recurrent_gated_delta_rule=recurrent_gated_delta_rule,
    routed_experts=routed_experts,
)
AUTO_TPU.update(
    tree_verify=lambda q, k, v: _fits(k, v, k.shape[1]),
    tree_commit=lambda cache: _fits(cache.k, cache.u, cache.k.shape[1]),
    chunk_gated_delta_rule=lambda q, k, v, chunk_size: _fits(k, v) and chunk_size in CHUNK_SIZES,
    recurrent_gated_delta_rule=lambda q, k, v: _fits(k, v),
)
