"""Tree WY verification and commit of a draft tree through one GDN layer (docs/design.md).

For a tree with inclusive ancestor mask ``P`` (``P[n, i] = 1`` iff ``i`` on ``path(n)``),
per value head (key head ``h // (Hv // Hk)``)::

    G = P g                                            # path log-decays, [N]
    A[n, i] = beta_n exp(G_n - G_i) (k_n . k_i)        for i in anc(n), else 0
    (I + A) U = diag(beta) (V - diag(exp(G)) K S0)     # ONE unit-lower-triangular solve, [N, V]
    O = diag(exp(G)) Q S0 + ((Q K^T) * D) U,           D[n, i] = exp(G_n - G_i) if i in path(n)

``O[n]`` equals the output of the sequential recurrence run along ``path(n)`` from ``S0``. The
verify cache keeps ``U``, the keys, ``G`` and the topology: never a per-node ``K x V`` state.
Commit of an accepted chain ``a_1..a_m``::

    S_new = exp(G_{a_m}) S0 + sum_j exp(G_{a_m} - G_{a_j}) k_{a_j} u_{a_j}^T
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax._prep import (
    HIGHEST,
    as_arrays,
    check_rule_inputs,
    concrete,
    group_heads,
    prepare_qk,
    ungroup_heads,
)
from gdn_jax.chunk import masked_decay
from gdn_jax.dispatch import pallas_op, resolve_impl
from gdn_jax.solve import unit_lower_solve
from gdn_jax.tree import validate_parents, validate_path


@dataclasses.dataclass(frozen=True)
class TreeCache:
    """What ``tree_commit`` needs from ``tree_verify`` (a pytree; ``qk_l2norm`` is static).

    - ``u``: f32 ``[B, N, Hv, V]`` pseudo-values ``U``;
    - ``k``: ``[B, N, Hk, K]`` the keys as given to ``tree_verify`` (before the l2norm, which
      commit re-applies when ``qk_l2norm``: the same op on the same input, so bit-identical);
    - ``g_path``: f32 ``[B, N, Hv]`` path log-decays ``G``;
    - ``parents``: int32 ``[B, N]``, for validating commit paths on the host.
    """

    u: jax.Array
    k: jax.Array
    g_path: jax.Array
    parents: jax.Array
    qk_l2norm: bool = False

    def nbytes_per_node(self) -> int:
        """Speculative bytes one draft node costs in this cache (all heads, one layer)."""
        n = self.u.shape[1]
        total = sum(x.size * x.dtype.itemsize for x in (self.u, self.k, self.g_path, self.parents))
        return total // (self.u.shape[0] * n)

    def commit_with(self, kernel, initial_state, path, path_len, **options):
        """The committed state from a commit kernel of the ``pallas_kernels`` signature
        (:func:`pallas_kernels.tree_commit`, :func:`pallas_kernels.tpu.tree_commit`): ``kernel(
        initial_state, k, u, g_path, path, path_len, use_qk_l2norm=..., **options)`` on this
        cache."""
        return kernel(
            initial_state,
            self.k,
            self.u,
            self.g_path,
            path,
            path_len,
            use_qk_l2norm=self.qk_l2norm,
            **options,
        )


jax.tree_util.register_dataclass(
    TreeCache, data_fields=["u", "k", "g_path", "parents"], meta_fields=["qk_l2norm"]
)


def ancestor_closure(parents: Int[Array, "B N"]) -> jax.Array:
    """bool ``[B, N, N]`` inclusive ancestor mask from parent ids, on device.

    Repeated squaring of ``I + onehot(parent)``: ``ceil(log2 N)`` boolean matmuls. Parents below
    zero (``-1`` roots, ``-2`` padding) have no edge.
    """
    n = parents.shape[-1]
    edge = jax.nn.one_hot(parents, n, dtype=jnp.float32)  # -1 / -2 give all-zero rows
    reach = jnp.minimum(edge + jnp.eye(n, dtype=jnp.float32), 1.0)
    for _ in range(max(n - 1, 1).bit_length()):
        reach = jnp.minimum(jnp.einsum("bij,bjk->bik", reach, reach, precision=HIGHEST), 1.0)
    return reach > 0.5


def _check_parents(parents: jax.Array, b: int, n: int) -> jax.Array:
    if parents.ndim == 1:
        parents = jnp.broadcast_to(parents, (b, parents.shape[0]))
    if parents.shape != (b, n):
        raise ValueError(f"parents: expected shape [B, N] = {(b, n)} (or [N]), got {parents.shape}")
    if not jnp.issubdtype(parents.dtype, jnp.integer):
        raise ValueError(f"parents: must be integer, got {parents.dtype}")
    host = concrete(parents)
    if host is not None:
        validate_parents(host)
    return parents.astype(jnp.int32)


def tree_verify(
    q: Float[Array, "B N Hk K"],
    k: Float[Array, "B N Hk K"],
    v: Float[Array, "B N Hv V"],
    g: Float[Array, "B N Hv"],
    beta: Float[Array, "B N Hv"],
    parents: Int[Array, "B N"],
    initial_state: Float[Array, "B Hv K V"],
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[Float[Array, "B N Hv V"], TreeCache]:
    """Outputs of every draft-tree node through one GDN layer, by the tree WY transform.

    ``O[b, n]`` equals ``recurrent_gated_delta_rule`` run along ``path(n)`` from
    ``initial_state[b]`` (module docstring for the math). Topology is data: one compiled program
    serves every tree of the same ``N``. Host-visible ``parents`` are validated.

    Returns ``(o [B, N, Hv, V] in v's dtype, TreeCache)``.
    """
    q, k, v, g, beta, parents, initial_state = as_arrays(q, k, v, g, beta, parents, initial_state)
    b, n, hk, hv, dk, dv = check_rule_inputs(q, k, v, g, beta, initial_state, time_name="N")
    parents = _check_parents(parents, b, n)
    kernel = resolve_impl(impl, "tree_verify", q, k, v)
    if kernel != "xla":
        o, u, g_path = pallas_op("tree_verify", kernel)(
            q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
        return o, TreeCache(u, k, g_path, parents, use_qk_l2norm)
    o, u, g_path = _tree_verify_xla(
        q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    return o, TreeCache(u, k, g_path, parents, use_qk_l2norm)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def _tree_verify_xla(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """The XLA path of :func:`tree_verify`: ``(o, U, G)``."""
    n, hk = k.shape[1], k.shape[2]
    qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    incl = ancestor_closure(parents)  # [B, N, N]
    strict = incl & ~jnp.eye(n, dtype=bool)
    g_path = jnp.einsum(
        "bni,bih->bnh", incl.astype(jnp.float32), g.astype(jnp.float32), precision=HIGHEST
    )
    gp = group_heads(jnp.swapaxes(g_path, 1, 2), hk, 1)  # [B, Hk, Gr, N]
    bt = group_heads(jnp.swapaxes(beta.astype(jnp.float32), 1, 2), hk, 1)
    vt = group_heads(jnp.moveaxis(v.astype(jnp.float32), 1, 2), hk, 1)  # [B, Hk, Gr, N, V]
    s0 = group_heads(initial_state.astype(jnp.float32), hk, 1)  # [B, Hk, Gr, K, V]

    gi, gj = gp[..., :, None], gp[..., None, :]
    kk = jnp.einsum("bnhk,bmhk->bhnm", kf, kf, precision=HIGHEST)[:, :, None]
    a = bt[..., None] * masked_decay(gi, gj, strict[:, None, None]) * kk
    ks0 = jnp.einsum("bnhk,bhgkv->bhgnv", kf, s0, precision=HIGHEST)
    rhs = bt[..., None] * (vt - jnp.exp(gp)[..., None] * ks0)
    u = unit_lower_solve(a, rhs)

    qs0 = jnp.einsum("bnhk,bhgkv->bhgnv", qf, s0, precision=HIGHEST)
    qk = jnp.einsum("bnhk,bmhk->bhnm", qf, kf, precision=HIGHEST)[:, :, None]
    att = qk * masked_decay(gi, gj, incl[:, None, None])
    o = jnp.exp(gp)[..., None] * qs0 + jnp.einsum("bhgnm,bhgmv->bhgnv", att, u, precision=HIGHEST)

    o = jnp.moveaxis(ungroup_heads(o, 1), 2, 1).astype(v.dtype)  # [B, N, Hv, V]
    u = jnp.moveaxis(ungroup_heads(u, 1), 2, 1)
    return o, u, g_path


def _check_commit(initial_state, cache: TreeCache, path, path_len):
    b, n, hv, dv = cache.u.shape
    hk, dk = cache.k.shape[2], cache.k.shape[3]
    if initial_state.shape != (b, hv, dk, dv):
        raise ValueError(
            f"initial_state: expected [B, Hv, K, V] = {(b, hv, dk, dv)} to match the cache, "
            f"got {initial_state.shape}"
        )
    if path.ndim != 2 or path.shape[0] != b:
        raise ValueError(f"path: expected shape [B={b}, D], got {path.shape}")
    if path_len.shape != (b,):
        raise ValueError(f"path_len: expected shape [B] = ({b},), got {path_len.shape}")
    for name, x in (("path", path), ("path_len", path_len)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: must be integer, got {x.dtype}")
    hosts = [concrete(x) for x in (cache.parents, path, path_len)]
    if all(h is not None for h in hosts):
        validate_path(*hosts)
    return b, hk


def tree_commit(
    initial_state: Float[Array, "B Hv K V"],
    cache: TreeCache,
    path: Int[Array, "B D"],
    path_len: Int[Array, " B"],
    *,
    impl: str = "auto",
) -> Float[Array, "B Hv K V"]:
    """The recurrent state after the accepted chain ``path[b, :path_len[b]]`` (root to leaf).

    ``S_new = exp(G_last) S0 + K_path^T (w * U_path)``, ``w_j = exp(G_last - G_{a_j})``: reads
    ``path_len`` rows of ``K``, ``U``, ``G``. ``path_len == 0`` returns ``initial_state`` unchanged.
    Returns f32 ``[B, Hv, K, V]``.
    """
    initial_state, path, path_len = as_arrays(initial_state, path, path_len)
    _check_commit(initial_state, cache, path, path_len)
    kernel = resolve_impl(impl, "tree_commit", cache)
    if kernel != "xla":
        return pallas_op("tree_commit", kernel)(initial_state, cache, path, path_len)
    return _tree_commit_xla(initial_state, cache, path, path_len)


@jax.jit
def _tree_commit_xla(initial_state, cache, path, path_len):
    """The XLA path of :func:`tree_commit`."""
    hk = cache.k.shape[2]
    d = path.shape[1]
    n = cache.u.shape[1]
    path = path.astype(jnp.int32)
    path_len = path_len.astype(jnp.int32)
    valid = jnp.arange(d)[None, :] < path_len[:, None]  # [B, D]
    idx = jnp.where(valid, jnp.clip(path, 0, n - 1), 0)
    last = jnp.take_along_axis(idx, jnp.maximum(path_len - 1, 0)[:, None], axis=1)  # [B, 1]
    g_last = jnp.take_along_axis(cache.g_path, last[:, :, None], axis=1)[:, 0]  # [B, Hv]
    g_last = jnp.where(path_len[:, None] > 0, g_last, 0.0)
    g_sel = jnp.take_along_axis(cache.g_path, idx[:, :, None], axis=1)  # [B, D, Hv]
    w = masked_decay(g_last[:, None, :], g_sel, valid[:, :, None])
    _, kf = prepare_qk(None, cache.k, scale=None, use_qk_l2norm=cache.qk_l2norm)
    k_sel = jnp.take_along_axis(kf, idx[:, :, None, None], axis=1)  # [B, D, Hk, K]
    u_sel = jnp.take_along_axis(cache.u, idx[:, :, None, None], axis=1)  # [B, D, Hv, V]
    wu = group_heads(w[..., None] * u_sel, hk, 2)  # [B, D, Hk, Gr, V]
    s0 = initial_state.astype(jnp.float32)
    upd = ungroup_heads(jnp.einsum("bdhk,bdhgv->bhgkv", k_sel, wu, precision=HIGHEST), 1)
    s_new = jnp.exp(g_last)[..., None, None] * s0 + upd
    return jnp.where((path_len > 0)[:, None, None, None], s_new, s0)
