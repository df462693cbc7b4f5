"""Tree WY verification of a draft tree through one GDN layer (docs/design.md, "Verify: one
solve"), fused.

One program per (batch row, value head, block of value columns). With the inclusive ancestor
mask ``P`` (built in-kernel from the parent ids, or passed in precomputed)::

    G = P g;  A[n, i] = beta_n exp(G_n - G_i) (k_n . k_i), i a strict ancestor of n
    U = (I + A)^-1 diag(beta) (V - diag(e^G) K S0)
    O = diag(e^G) Q S0 + ((Q K^T) * D) U

``S0`` is read from HBM once; grouped heads read key head ``h // (Hv // Hk)`` through the index
map. How the dots are spent (``VerifyBlocks.mode``):

- ``"refine"`` (default): every dot but one is a single tensor-core pass; exactness comes from the
  structure, not from split operands. bf16 q/k enter their dots raw (bf16 x bf16 products are
  exact in the f32 accumulator; the l2norm and scale are row/column scales applied after);
  ``K S0`` and ``Q S0`` split only the f32 state into two bf16 halves (2 passes, ~2^-16
  relative). The inverse ``T0 ~ (I + A)^-1`` is built by product doubling in single-pass bf16
  (``inverse_precision``; tf32 optional) with only as many doublings as the tree is deep
  (``2^J >= depth``: ``A^depth = 0``); trees deeper than :data:`DOUBLING_MAX_DEPTH` invert the
  diagonal blocks of :data:`INVERSE_BLOCK` nodes so and the rest by block substitution
  (:func:`inverse_by_depth`: whole-tree doubling of a deep path of alike keys loses ``T0`` in
  bf16). ``U`` is then corrected by iterative refinement,
  ``U <- U + T0 (rhs - (I + A) U)`` (``refine_steps``, default 2), whose residual dot runs at
  ``precision`` (bf16x3/tf32x3): each step multiplies the error by ``|I - T0 (I + A)|``
  (~4e-3 for a bf16 ``T0``, ~5e-4 for tf32). ``((Q K^T) * D) U`` runs at ``precision`` too
  (``output_precision="x3"``; one tf32 pass measured no faster on the H200 and left a 1e-3
  relative error in a bf16 ``O``, against 1.3e-4 at x3).
- ``"x3"``: every dot at ``precision`` (3 passes) and the full doubling (``log2 N`` steps), no
  refinement.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import (
    F32,
    PRECISIONS,
    ancestor_closure,
    check_blocks,
    check_max_nodes,
    dot,
    dot_precision,
    masked_decay,
    next_pow2,
    prep_rows,
    prepare_tree_launch,
    wy_block,
)

# Node limit of the kernels. On GPU a block gets at most GPU_SHARED_MEMORY bytes of shared
# memory (227 KiB on the H200): the refine kernel's need is refine_shared_memory (f32 q/k at
# 128 nodes and K 128 with tf32x3 dots ask for 256 KiB); the x3 kernel's 128-node f32 tile asks
# for 320 KiB, so on GPU it stops at GPU_MAX_NODES_X3. Interpret mode has no such limit.
MAX_NODES = 128
GPU_MAX_NODES_X3 = 64
GPU_SHARED_MEMORY = 232448
BF16 = jnp.bfloat16
# Diagnostic cut points of the refine kernel ("" = the whole kernel).
STAGES = ("", "load", "products", "matrix", "inverse", "refine")
ONE_PASS = {"bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32, "tf32": None}


@dataclasses.dataclass(frozen=True)
class VerifyBlocks:
    """Static knobs of the verify kernel.

    ``block_v``: value columns per program; ``num_warps`` / ``num_stages``: Triton launch;
    ``mode``: ``"refine"`` or ``"x3"`` (module docstring); ``precision``: the 3-pass dots
    (``"tf32x3"``, ``"bf16x3"`` or ``"highest"``); ``inverse_precision``: the single-pass
    dots of the approximate inverse (``"tf32"`` or ``"bf16"``); ``refine_steps``: refinement
    steps of ``U``; ``output_precision``: the ``((Q K^T) * D) U`` dot (``"tf32"``: one pass,
    ~1e-3 relative error in O; ``"x3"`` (default): at ``precision``; ``"auto"``: ``"tf32"`` for 2-byte
    outputs, ``"x3"`` for f32); ``depth_loop``: the inverse's work sized by the tree's depth
    (else by ``N``, as for a chain of ``N`` nodes); ``ancestors_input``: the wrapper computes ``P`` with XLA and the kernel
    loads it (else the kernel squares ``I + onehot(parent)`` itself); ``stop_after``:
    **diagnostics only** (``benchmarks/kernels.py --breakdown``): end the kernel after one of
    :data:`STAGES` and store what exists then (the outputs are not the verify's), so the
    stages' costs can be timed apart.
    """

    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"
    mode: str = "refine"
    inverse_precision: str = "bf16"
    refine_steps: int = 2
    output_precision: str = "x3"
    depth_loop: bool = True
    ancestors_input: bool = False
    stop_after: str = ""

    def __post_init__(self):
        if self.mode not in ("refine", "x3"):
            raise ValueError(f"blocks.mode: 'refine' or 'x3', got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"blocks.precision: one of {tuple(PRECISIONS)}, got {self.precision!r}"
            )
        if self.inverse_precision not in ONE_PASS:
            raise ValueError(
                f"blocks.inverse_precision: one of {tuple(ONE_PASS)}, got {self.inverse_precision!r}"
            )
        if self.output_precision not in ("auto", "tf32", "x3"):
            raise ValueError(
                f"blocks.output_precision: 'auto', 'tf32' or 'x3', got {self.output_precision!r}"
            )
        if not 0 <= self.refine_steps <= 4:
            raise ValueError(f"blocks.refine_steps: 0..4, got {self.refine_steps}")
        if self.stop_after not in STAGES:
            raise ValueError(f"blocks.stop_after: one of {STAGES}, got {self.stop_after!r}")
        if self.stop_after and self.mode != "refine":
            raise ValueError("blocks.stop_after: only the 'refine' mode has stages")


DEFAULT_VERIFY_BLOCKS = VerifyBlocks()


def refine_shared_memory(npad: int, dk: int, bv: int, low: bool, precision: str) -> int:
    """Bytes of shared memory per block that the refine kernel's GPU build asks for (sm_90,
    jax 0.11.2's XLA Triton pipeline): ``npad`` padded nodes, key dim ``dk``, ``bv`` value
    columns per program, ``low`` for raw bf16 q and k, ``precision`` of the 3-pass dots.

    The largest set of dot operands staged at once (``N = npad``): the bf16 ``[N, N]`` operands
    of the one-pass inverse (``4 N^2``); a split x3 operand takes ``e`` bytes per element
    (tf32x3: 8, bf16x3: 4): ``U`` in the residual and output dots (``e N bv``) and, for q/k that
    are not both bf16, both q and k (``2 e N dk``) and k with the ``S0`` tile
    (``e dk (N + bv)``), one operand at a time below 64 rows (``e N dk``, ``4 dk bv``); raw bf16
    q, k and the two bf16 halves of ``S0`` (``4 dk (N + bv)``); ``"highest"`` (f32 FMA dots):
    ``6 N^2``, ``8 N bv`` and for f32 q/k ``8 N dk + 4 dk max(bv, 32)``. Fitted to deviceless
    compiles (``benchmarks/results/compile_report/verify_smem.json``: N 16 to 128, K 16 to 256,
    block_v 16 to 256, the dense and the arena kernel): equal to the build's figure on 453 of
    486 configurations and above it on the rest, refusing 6 builds that would fit (N 128 with
    block_v 256 and ``"highest"``, or f32 q/k, K 256, block_v 128 and bf16x3). The other knobs
    (warps, ``ancestors_input``, inverse and output precision, refinement steps) measured no
    change.
    """
    n = npad
    terms = [4 * n * n]
    if precision == "highest":
        terms += [6 * n * n, 8 * n * bv]
        if not low:
            terms.append(8 * n * dk + 4 * dk * max(bv, 32))
    else:
        e = 8 if precision == "tf32x3" else 4
        terms.append(e * n * bv)
        if not low:
            wide = n >= 64
            terms += [2 * e * n * dk, e * dk * (n + bv)] if wide else [e * n * dk, 4 * dk * bv]
    if low:
        terms.append(4 * dk * (n + bv))
    return max(terms)


def check_gpu_limits(blocks: VerifyBlocks, n: int, dk: int, dv: int, q_dtype, k_dtype) -> None:
    """ValueError naming the limit when the verify kernel's GPU build for ``n`` nodes could not
    launch: the x3 kernel above :data:`GPU_MAX_NODES_X3` nodes, the refine kernel when
    :func:`refine_shared_memory` exceeds :data:`GPU_SHARED_MEMORY`."""
    if blocks.mode == "x3":
        if n > GPU_MAX_NODES_X3:
            raise ValueError(
                f"N: on GPU the x3-mode tree_verify kernel supports at most {GPU_MAX_NODES_X3} "
                f"nodes (a 128-node tile exceeds the 227 KiB shared memory per block), got {n}; "
                "use mode='refine' or the XLA path"
            )
        return
    npad, bv = next_pow2(n, 16), min(blocks.block_v, dv)
    low = jnp.dtype(q_dtype) == BF16 and jnp.dtype(k_dtype) == BF16
    need = refine_shared_memory(npad, dk, bv, low, blocks.precision)
    if need <= GPU_SHARED_MEMORY:
        return
    dtypes = "/".join(sorted({jnp.dtype(q_dtype).name, jnp.dtype(k_dtype).name}))
    hint = "fewer nodes or the XLA path"
    if refine_shared_memory(npad, dk, bv, low, "bf16x3") <= GPU_SHARED_MEMORY:
        hint = "precision='bf16x3', " + hint
    raise ValueError(
        f"N: on GPU the tree_verify kernel for {n} nodes (padded to {npad}), {dtypes} q/k, K {dk},"
        f" block_v {bv} and precision={blocks.precision!r} needs {need // 1024} KiB of shared "
        f"memory per block, over the 227 KiB ({GPU_SHARED_MEMORY} bytes) of the H200; use {hint}"
    )


def _one_pass(name: str, interpret: bool):
    # CPU has no tf32 and no bf16-algorithm dots: interpret mode runs plain dots (the f32
    # operands then multiply exactly, which the tests allow for).
    return None if interpret else ONE_PASS[name]


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """XLA: bool ``[B, N, N]`` inclusive ancestor mask (exact bf16 squarings, f32 sums)."""
    n = parents.shape[-1]
    eye = jnp.eye(n, dtype=bool)
    reach = (parents[..., :, None] == jnp.arange(n)) | eye
    for _ in range(max(n - 1, 1).bit_length()):
        r = reach.astype(BF16)
        reach = jnp.einsum("bij,bjk->bik", r, r, preferred_element_type=F32) > 0.5
    return reach


# Trees deeper than this invert (I + A) by blocks (inverse_by_depth): the product doubling's
# intermediate powers A^(2^j) grow like binomial coefficients of the depth when keys along a
# path are alike and decay is slow, and one-pass bf16 products then lose T0 entirely (a 64-node
# chain of near-equal keys at g ~ -0.01: U off by 3e6 after refinement; at depth <= 16 the same
# inputs stay within 2e-6). Block substitution only multiplies bounded pieces of the inverse.
DOUBLING_MAX_DEPTH = 16
INVERSE_BLOCK = 8


def _doublings(depth, limit: int):
    """Product-doubling steps after ``I - A`` that cover paths of ``depth`` nodes (``2^(s+1) >=
    depth``), for ``depth <= limit``."""
    factors = jnp.int32(0)
    for j in range(max(limit - 1, 1).bit_length()):
        factors = factors + (depth > (1 << j)).astype(jnp.int32)
    return jnp.maximum(factors - 1, 0)


def inverse_by_depth(a, depth, precision):
    """``T0 ~ (I + A)^-1`` for strictly lower ``A [n, n]`` whose longest path has ``depth``
    nodes: product doubling up to :data:`DOUBLING_MAX_DEPTH`; deeper, the diagonal blocks of
    :data:`INVERSE_BLOCK` nodes by doubling (``T_D``) and the rest by block substitution,
    ``T = T_D - M T`` with ``M = T_D L`` iterated once per block a path can cross (``L``:
    ``A`` off the diagonal blocks). Either way the dots run at ``precision``."""
    n = a.shape[0]
    deep = depth > DOUBLING_MAX_DEPTH
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    shift = (INVERSE_BLOCK - 1).bit_length()
    same = ((row >> shift) == (col >> shift)) | ~deep  # shallow: one block, all of A
    deep_i = deep.astype(jnp.int32)  # (a where over constants lowers to i1 in Triton)
    block_depth = jnp.minimum(depth, n - (n - min(INVERSE_BLOCK, n)) * deep_i)
    td = _inverse_doubling(jnp.where(same, a, 0.0), _doublings(block_depth, n), precision)
    levels = jnp.minimum(depth - 1, max(n // INVERSE_BLOCK - 1, 0)) * deep_i
    m = dot(td, jnp.where(same, 0.0, a), precision)  # zero when shallow

    def substitute(_, t):
        return td - dot(m, t, precision)

    return jax.lax.fori_loop(0, levels, substitute, td)


def _inverse_doubling(a, iters, precision):
    """``T ~ (I + A)^-1 = (I - A)(I + A^2)...(I + A^(2^iters))`` for strictly lower ``A``."""
    n = a.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    t = jnp.where(row == col, 1.0, 0.0) - a

    def body(_, tp):
        t, p = tp
        p = dot(p, p, precision)
        return t + dot(t, p, precision), p

    if isinstance(iters, int):
        for i in range(iters):
            t, a = body(i, (t, a))
        return t
    return jax.lax.fori_loop(0, iters, body, (t, a))[0]


def _rows_scale(x, use_l2norm: bool, scale: float | None):
    """Row scales ``rsqrt(|x_n|^2 + eps) * scale`` (f32 ``[N]``) that make ``x`` l2-normalised."""
    n = x.shape[0]
    s = jnp.ones((n,), F32) if scale is None else jnp.full((n,), scale, F32)
    if not use_l2norm:
        return s
    xf = x.astype(F32)
    return s * jax.lax.rsqrt(jnp.sum(xf * xf, axis=1) + 1e-6)


def refine_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    anc_ref,
    s0_ref,
    o_ref,
    u_ref,
    gp_ref,
    *,
    scale,
    use_l2norm,
    blocks: VerifyBlocks,
    interpret,
):
    x3 = dot_precision(blocks.precision, interpret)
    inv_p = _one_pass(blocks.inverse_precision, interpret)
    out_x3 = blocks.output_precision == "x3" or (
        blocks.output_precision == "auto" and o_ref.dtype == jnp.float32
    )
    out_p = x3 if out_x3 else _one_pass("tf32", interpret)
    qr, kr = q_ref[...], k_ref[...]
    low = qr.dtype == BF16 and kr.dtype == BF16
    rq = _rows_scale(qr, use_l2norm, scale)
    rk = _rows_scale(kr, use_l2norm, None)
    s0 = s0_ref[...].astype(F32)
    stop = blocks.stop_after

    def cut(o, u, gp):
        o_ref[...] = o.astype(o_ref.dtype)
        u_ref[...] = u
        gp_ref[...] = gp

    if stop == "load":
        anc = anc_ref[...].astype(F32)
        col_sum = jnp.sum(s0, axis=0)[None, :]
        rows = rq + rk + g_ref[...].astype(F32) + beta_ref[...].astype(F32)
        if anc.ndim == 2:
            rows = rows + jnp.sum(anc, axis=1)
        else:
            rows = rows + anc
        return cut(v_ref[...].astype(F32) + col_sum, rows[:, None] + col_sum, rows)
    if low:
        # Raw bf16 operands: exact products, f32 accumulation; the state split in two halves.
        one = _one_pass("bf16", interpret)
        s_hi = s0.astype(BF16)
        s_lo = (s0 - s_hi.astype(F32)).astype(BF16)
        kk = dot(kr, kr, one, trans_b=True)
        qk = dot(qr, kr, one, trans_b=True)
        ks = dot(kr, s_hi, one) + dot(kr, s_lo, one)
        qs = dot(qr, s_hi, one) + dot(qr, s_lo, one)
    else:
        qf, kf = qr.astype(F32), kr.astype(F32)
        kk = dot(kf, kf, x3, trans_b=True)
        qk = dot(qf, kf, x3, trans_b=True)
        ks, qs = dot(kf, s0, x3), dot(qf, s0, x3)
    kk = kk * rk[:, None] * rk[None, :]
    qk = qk * rq[:, None] * rk[None, :]
    ks, qs = ks * rk[:, None], qs * rq[:, None]
    if stop == "products":
        rows = jnp.sum(kk + qk, axis=1)
        return cut(qs, ks + rows[:, None], rows)

    if blocks.ancestors_input:
        incl = anc_ref[...] != 0
    else:
        incl = ancestor_closure(anc_ref[...])
    n = incl.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    strict = incl & (row != col)
    g_path = jnp.sum(jnp.where(incl, g_ref[...].astype(F32)[None, :], 0.0), axis=1)
    decay = masked_decay(g_path[:, None], g_path[None, :], incl)
    beta = beta_ref[...].astype(F32)
    a = beta[:, None] * jnp.where(strict, decay, 0.0) * kk
    eg = jnp.exp(g_path)[:, None]
    rhs = beta[:, None] * (v_ref[...].astype(F32) - eg * ks)
    if stop == "matrix":
        return cut(qs, rhs + jnp.sum(a, axis=1)[:, None], g_path)

    # nodes on the longest root path; (I + A)^-1 = sum_{m < depth} (-A)^m
    depth = jnp.max(jnp.sum(jnp.where(incl, 1, 0), axis=1))
    t0 = inverse_by_depth(a, depth if blocks.depth_loop else jnp.int32(n), inv_p)
    u = dot(t0, rhs, inv_p)
    if stop == "inverse":
        return cut(qs, u, g_path)
    for _ in range(blocks.refine_steps):
        r = rhs - u - dot(a, u, x3)
        u = u + dot(t0, r, inv_p)
    if stop == "refine":
        return cut(qs, u, g_path)
    o = eg * qs + dot(qk * decay, u, out_p)
    o_ref[...] = o.astype(o_ref.dtype)
    u_ref[...] = u
    gp_ref[...] = g_path


def _x3_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    par_ref,
    s0_ref,
    o_ref,
    u_ref,
    gp_ref,
    *,
    scale,
    use_l2norm,
    blocks: VerifyBlocks,
    interpret,
):
    precision = dot_precision(blocks.precision, interpret)
    q = prep_rows(q_ref[...], use_l2norm, scale)
    k = prep_rows(k_ref[...], use_l2norm)
    if blocks.ancestors_input:
        incl = par_ref[...] != 0
    else:
        incl = ancestor_closure(par_ref[...])
    n = incl.shape[0]
    strict = incl & (
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
        != jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    )
    g_path = jnp.sum(jnp.where(incl, g_ref[...].astype(F32)[None, :], 0.0), axis=1)
    decay = masked_decay(g_path[:, None], g_path[None, :], incl)
    o, u = wy_block(
        q,
        k,
        v_ref[...].astype(F32),
        beta_ref[...].astype(F32),
        g_path,
        decay,
        strict,
        s0_ref[...].astype(F32),
        precision,
    )
    o_ref[...] = o.astype(o_ref.dtype)
    u_ref[...] = u
    gp_ref[...] = g_path


def tree_input(parents: jax.Array, ancestors, n: int, ancestors_input: bool) -> jax.Array:
    """The verify kernels' tree operand from the launch's padded ``parents [B, Npad]``: those
    parents, or with ``ancestors_input`` the int8 inclusive ancestor mask ``[B, Npad, Npad]``
    (``ancestors`` of the ``n`` real nodes when given, else computed; padding nodes are their
    own only ancestor). ``ValueError`` for ``ancestors`` without ``ancestors_input`` or of the
    wrong shape."""
    if ancestors is not None and not ancestors_input:
        raise ValueError("ancestors: only used with blocks.ancestors_input=True")
    if not ancestors_input:
        return parents
    if ancestors is None:
        # One XLA computation per call (under jit, CSE shares it between identical calls).
        return ancestor_mask(parents).astype(jnp.int8)
    b, npad = parents.shape
    if ancestors.shape != (b, n, n):
        raise ValueError(f"ancestors: shape {(b, n, n)} expected, got {ancestors.shape}")
    tree = (ancestors != 0).astype(jnp.int8)
    if npad != n:
        tree = jnp.pad(tree, ((0, 0), (0, npad - n), (0, npad - n)))
        tree = tree | (jnp.eye(npad, dtype=jnp.int8) * (jnp.arange(npad) >= n))
    return tree


def verify_specs(t, v: jax.Array):
    """Block specs of ``q, k, v, g, beta`` (inputs) and ``o, u, g_path`` (outputs) with their
    shapes, on the (row, value head, column block) grid of a :class:`TreeLaunch` ``t``; ``v`` is
    the padded values (its dtype is the output's)."""
    b, npad, hv, dv = v.shape
    dk = t.k.shape[3]
    qk = pl.BlockSpec((None, npad, None, dk), lambda i, h, j: (i, 0, h // t.grp, 0))
    vo = pl.BlockSpec((None, npad, None, t.bv), lambda i, h, j: (i, 0, h, j))
    gb = pl.BlockSpec((None, npad, None), lambda i, h, j: (i, 0, h))
    out_shape = [
        jax.ShapeDtypeStruct((b, npad, hv, dv), v.dtype),
        jax.ShapeDtypeStruct((b, npad, hv, dv), F32),
        jax.ShapeDtypeStruct((b, npad, hv), F32),
    ]
    return [qk, qk, vo, gb, gb], [vo, vo, gb], out_shape


def tree_verify(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    parents: jax.Array,
    initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    blocks: VerifyBlocks = DEFAULT_VERIFY_BLOCKS,
    ancestors: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree WY verify. ``q, k [B, N, Hk, K]``, ``v [B, N, Hv, V]``, ``g, beta [B, N, Hv]``,
    ``parents`` int ``[B, N]``, ``initial_state [B, Hv, K, V]``.

    With ``blocks.ancestors_input`` the kernel loads the inclusive ancestor mask instead of
    squaring the parent matrix itself: pass it as ``ancestors`` (bool or int ``[B, N, N]``,
    :func:`ancestor_mask` of ``parents``; one computation serves every layer of a model step),
    else it is computed here per call. ``ancestors`` is trusted to match ``parents``.

    Returns ``(o [B, N, Hv, V] in v's dtype, u f32 [B, N, Hv, V], g_path f32 [B, N, Hv])``.
    ``N`` is padded to a power of two >= 16 (padding nodes have parent -2 and zero inputs).
    Off interpret mode, a build that could not launch on the GPU raises ``ValueError`` before
    lowering (:func:`check_gpu_limits`).
    """
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_max_nodes(n, MAX_NODES, "Pallas tree_verify kernel")
    check_blocks(blocks, VerifyBlocks)
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    if not interpret:
        check_gpu_limits(blocks, n, dk, dv, q.dtype, k.dtype)
    q, k, v, g, beta, parents = t[:6]
    npad, bv, scale = t.npad, t.bv, t.scale

    body = refine_kernel if blocks.mode == "refine" else _x3_kernel
    kernel = functools.partial(
        body, scale=scale, use_l2norm=use_qk_l2norm, blocks=blocks, interpret=interpret
    )
    tree = tree_input(parents, ancestors, n, blocks.ancestors_input)
    if blocks.ancestors_input:
        tree_spec = pl.BlockSpec((None, npad, npad), lambda i, h, j: (i, 0, 0))
    else:
        tree_spec = pl.BlockSpec((None, npad), lambda i, h, j: (i, 0))
    in_specs, out_specs, out_shape = verify_specs(t, v)
    o, u, g_path = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[
            *in_specs,
            tree_spec,
            pl.BlockSpec((None, None, dk, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_verify",
    )(q, k, v, g, beta, tree, initial_state)
    if npad != n:
        o, u, g_path = o[:, :n], u[:, :n], g_path[:, :n]
    return o, u, g_path
