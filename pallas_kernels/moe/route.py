"""The MoE router's top-k in one kernel: ``(weights [M, k], expert ids [M, k])`` from the
router's logits ``[M, E]``.

Program ``m`` holds row ``m``'s ``E`` logits in registers and picks the ``k`` largest one at a
time (the largest value, the lowest expert id among equal values, a NaN above every number,
as ``lax.top_k``: ids stay in ``[0, E)`` whatever the logits), then
forms their weights in f32: with ``normalize`` the softmax over the ``k`` selected logits (the
renormalised top-k of ``softmax(logits)``), otherwise their probabilities under the softmax
over all ``E``. XLA runs the same as a sort over the experts, a slice of its ids and a softmax
fusion: three kernels where this is one. A row is read as a power of two of lanes (``-inf``
past ``E``), its ``k`` weights and ids stored likewise under a mask (no slice after the
kernel where ``k`` is not a power of two).

With ``balanced`` the kernel is :func:`gdn_jax.moe.balanced_route` (a benchmark's stand-in
router): program ``m`` takes the ids ``r + C j`` (``j < k``, ``C = E // k``) of the residue
class ``r = murmur3_finaliser(m + 1) mod C`` (uint32 arithmetic) instead of the top-k, whatever
the logits, and weights them by the same rule; XLA runs it as a gather and a softmax fusion.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32, next_pow2


def check_route(logits, k: int, num_experts: int | None = None) -> tuple[int, int]:
    """``(M, E)``; ``ValueError`` for inputs the kernel cannot take."""
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [M, E], got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits: must be floating point, got {logits.dtype}")
    m, e = logits.shape[0], logits.shape[1] if num_experts is None else num_experts
    if not 1 <= e <= logits.shape[1]:
        raise ValueError(
            f"num_experts: must be in [1, {logits.shape[1]}] (logits' columns), got {e}"
        )
    if not 1 <= k <= e:
        raise ValueError(f"k: must be in [1, E = {e}], got {k}")
    return m, e


def _residue(m, classes: int):
    """int32 ``murmur3_finaliser(m + 1) mod classes`` of the row index ``m`` (uint32
    wraparound, logical shifts): :func:`gdn_jax.moe.balanced_route`'s class of row ``m``."""
    h = (m + 1).astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return jax.lax.rem(h ^ (h >> 16), jnp.uint32(classes)).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("k", "normalize", "dtype", "num_experts", "balanced", "interpret"),
)
def route_topk(
    logits,
    k: int,
    *,
    normalize: bool = True,
    dtype=F32,
    num_experts: int | None = None,
    balanced: bool = False,
    interpret: bool = False,
):
    """``(weights [M, k] in dtype (formed in f32), ids int32 [M, k])`` of the ``k`` largest
    logits per row (module docstring); with ``num_experts`` the logits are the first ``E``
    columns of a wider ``[M, >= E]`` array (a fused projection's output, read in place). With
    ``balanced`` the ids are :func:`gdn_jax.moe.balanced_route`'s residue class of the row, not
    the top-k, weighted by the same rule."""
    m, e = check_route(logits, k, num_experts)
    kp, ep = next_pow2(k, 1), next_pow2(e, 1)
    classes = e // k  # balanced: the residue classes

    def kernel(l_ref, w_ref, i_ref):
        lane = jax.lax.broadcasted_iota(jnp.int32, (ep,), 0)
        row = l_ref.at[pl.program_id(0), pl.ds(0, ep)]
        lg = plt.load(row, mask=lane < e, other=-jnp.inf).astype(F32)  # [E_pad], -inf past E
        slot = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)
        top = jnp.max(lg)
        vals = jnp.full((kp,), -jnp.inf, F32)
        if balanced:
            r = _residue(pl.program_id(0), classes)
            ids = r + classes * slot
            for j in range(k):  # class ids are < C k <= E: real logits, never the -inf padding
                v = jnp.sum(jnp.where(lane == r + classes * j, lg, 0.0))
                vals = jnp.where(slot == j, v, vals)
            if normalize:
                top = jnp.max(vals)  # the softmax of the k picked logits, as XLA's
        else:
            ids = jnp.zeros((kp,), jnp.int32)
            cur = jnp.where(jnp.isnan(lg), jnp.inf, lg)  # a NaN logit ranks first, as in top_k
            for j in range(k):
                best = jnp.max(cur)
                idx = jnp.min(jnp.where(cur == best, lane, e))
                vals = jnp.where(slot == j, jnp.sum(jnp.where(lane == idx, lg, 0.0)), vals)
                ids = jnp.where(slot == j, idx, ids)
                cur = jnp.where(lane == idx, -jnp.inf, cur)
        if balanced and not normalize:  # exp(logit - logsumexp(logits)), XLA's formula
            lse = top + jnp.log(jnp.sum(jnp.exp(lg - top)))
            w = jnp.where(slot < k, jnp.exp(vals - lse), 0.0)
        else:
            p = jnp.where(slot < k, jnp.exp(vals - top), 0.0)
            w = p / (jnp.sum(p) if normalize else jnp.sum(jnp.exp(lg - top)))
        out = (pl.program_id(0), pl.ds(0, kp))  # the row's k slots, stored under a mask
        plt.store(w_ref.at[out], w.astype(w_ref.dtype), mask=slot < k)
        plt.store(i_ref.at[out], ids, mask=slot < k)

    return pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=[pl.BlockSpec(memory_space=None)],
        out_specs=(pl.BlockSpec(memory_space=None), pl.BlockSpec(memory_space=None)),
        out_shape=(
            jax.ShapeDtypeStruct((m, k), dtype),
            jax.ShapeDtypeStruct((m, k), jnp.int32),
        ),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_route_topk",
    )(logits)
