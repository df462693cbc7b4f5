"""Tree WY verify of a draft tree through one GDN layer as a Mosaic TPU kernel (docs/design.md,
"Verify: one solve").

One program per (group of ``r`` batch rows, group of ``s`` value heads of one key head). The
group's ``r * s`` systems are stacked block-diagonally into one system of ``m = r s Npad`` rows
so that the ``[m, m]`` products fill the MXU (``m`` up to :attr:`TpuVerifyBlocks.mxu_rows`:
128 on v5e / v5p, 256 on v6e)::

    G = P g;   A[n, i] = beta_n exp(G_n - G_i) (k_n . k_i), i a strict ancestor of n
    U = (I + A)^-1 diag(beta) (V - diag(e^G) K S0)
    O = diag(e^G) Q S0 + ((Q K^T) * D) U

The inclusive ancestor mask ``P`` of the stacked systems (block diagonal, one ``[m, m]`` bf16
block per row group) is computed once per call by XLA and read once per row group. ``K K^T``
and ``Q K^T`` are one ``[2m, K] x [K, m]`` dot; ``K S0`` and ``Q S0`` one ``[2 Npad, K] x
[K, s V]`` dot per batch row (the ``s`` heads' states side by side on the lanes), or one
block-diagonal ``[r 2Npad, r K] x [r K, s V]`` dot for all ``r`` rows where ``r K`` fits the
MXU's width (a 256-wide MXU pads ``K = 128`` to 256 anyway; the default stacking prefers such
an ``(r, s)``, :meth:`TpuVerifyBlocks.stacking`). bf16 q / k enter their dots raw (exact
products); the l2norm and ``scale`` are row scales of the products, computed once per row.
The solve (``TpuVerifyBlocks.inverse``):

- ``"newton"``: ``X ~ (I + A)^-1`` by doubling, ``X = (I - A)(I + A^2)(I + A^4)...`` (two dots
  a step), its last step taken as a Newton-Schulz step ``X <- X + X (I - (I + A) X)``, which
  squares away the rounding of the earlier products; as many steps as the deepest stacked
  tree needs (``ceil(log2 depth) - 1``, a loop whose trip count XLA reads off ``P``), then
  ``U = X R``;
- ``"blocked"``: blocked forward substitution: the ``block x block`` diagonal blocks inverted
  at once by Newton-Schulz on the block-diagonal part of ``A``, then block row by block row
  ``U_i = X_ii (R_i - A_i,<i U_<i)``.

With ``refine_steps > 0`` the inverse is built in one-pass bf16 dots and ``U`` corrected by
``U <- U + X (R - (I + A) U)``, the residual at ``precision``; otherwise every dot of the solve
runs at ``precision``. Interpret mode runs these dots as the MXU does, so its errors against
float64 are the TPU's (``python -m benchmarks.tpu_accuracy``, docs/kernels.md).

The kernel reads head-major ``q, k [B, Hk, Npad, K]``, ``v [B, Hv, Npad, V]``, the stacked
per-node rows of ``g`` and ``beta`` and the states ``[B, Hv, K, V]``; :func:`tree_verify` takes
the op's ``[B, N, H, D]`` layout and transposes around the kernel (XLA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._arena import Value
from pallas_kernels._wy import (
    F32,
    check_blocks,
    check_max_nodes,
    default_scale,
    masked_decay,
    next_pow2,
    pad_axis,
)
from pallas_kernels.tpu._arena import any_spec, check_arena, lane_rows, load_states, state_rows
from pallas_kernels.tpu._common import (
    BF16,
    check_dims,
    check_precision,
    compiler_params,
    dot,
    eye_mask,
    head_major,
    interpret_params,
    iota,
    newton_inverse,
    newton_steps,
    row_scales,
    split,
    to_row,
    vmem_bytes,
)

MAX_NODES = 128
INVERSES = ("newton", "blocked")


@dataclasses.dataclass(frozen=True)
class TpuVerifyBlocks:
    """Static knobs of the TPU verify kernel.

    ``inverse``: ``"newton"`` or ``"blocked"`` (module docstring); ``block``: diagonal block
    rows of ``"blocked"`` (a power of two >= 8); ``refine_steps``: refinement steps of ``U``
    after a one-pass bf16 inverse (0: the whole solve at ``precision``); ``precision``: the
    dots between f32 values (``"bf16x3"`` or ``"bf16x6"``; :mod:`pallas_kernels.tpu._common`);
    ``mxu_rows``: stack systems (value heads of one key head, then batch rows) while
    ``systems * Npad <= mxu_rows`` (128: v5e / v5p MXUs, 256: v6e); ``heads`` / ``rows``:
    stacked heads / rows per program (0: from ``mxu_rows``).
    """

    inverse: str = "newton"
    block: int = 16
    refine_steps: int = 1
    precision: str = "bf16x3"
    mxu_rows: int = 128
    heads: int = 0
    rows: int = 0

    def __post_init__(self):
        if self.inverse not in INVERSES:
            raise ValueError(f"blocks.inverse: one of {INVERSES}, got {self.inverse!r}")
        if self.block < 8 or self.block & (self.block - 1):
            raise ValueError(f"blocks.block: a power of two >= 8, got {self.block}")
        if not 0 <= self.refine_steps <= 3:
            raise ValueError(f"blocks.refine_steps: 0..3, got {self.refine_steps}")
        check_precision("blocks.precision", self.precision)
        if self.precision == "bf16":
            raise ValueError("blocks.precision: 'bf16x3' or 'bf16x6' (one pass loses f32 accuracy)")
        if self.mxu_rows < 8:
            raise ValueError(f"blocks.mxu_rows: at least 8, got {self.mxu_rows}")
        if self.heads < 0 or self.rows < 0:
            raise ValueError("blocks.heads, blocks.rows: 0 (from mxu_rows) or a divisor")

    def stacking(self, b: int, grp: int, npad: int, dk: int = 0, dv: int = 0) -> tuple[int, int]:
        """``(rows, heads)`` stacked per program: ``heads`` divides ``grp = Hv / Hk`` and
        ``rows`` divides ``B``. By default the most systems ``rows * heads`` with ``rows *
        heads * npad <= mxu_rows`` (at least one); among those, one whose state product fits
        one MXU tile (``rows * dk`` and ``heads * dv`` at most ``mxu_rows``: a single
        block-diagonal dot, ``_state_products``), then the most heads."""
        if self.heads and grp % self.heads:
            raise ValueError(f"blocks.heads: {self.heads} must divide Hv / Hk = {grp}")
        if self.rows and b % self.rows:
            raise ValueError(f"blocks.rows: {self.rows} must divide B = {b}")
        heads = [self.heads] if self.heads else _divisors(grp)
        rows = [self.rows] if self.rows else _divisors(b)
        least = (rows[0], heads[0])
        options = [
            (r, s) for r in rows for s in heads if r * s * npad <= self.mxu_rows or (r, s) == least
        ]

        def rank(rs):
            r, s = rs
            tile = r * dk <= self.mxu_rows and s * dv <= self.mxu_rows
            return r * s, tile, s

        return max(options, key=rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DEFAULT_TPU_VERIFY_BLOCKS = TpuVerifyBlocks()


# Trees deeper than this (more inverse steps) take the block inverse (_block_inverse): along
# a deep path of alike keys with slow decay the doubling's powers A^(2^j) grow like binomial
# coefficients of the depth and one-pass bf16 loses X (a 64-node chain of keys at cosine
# 0.9996, g ~ -0.01: U off by 1e8; as pallas_kernels.verify.kernel.inverse_by_depth).
DEEP_STEPS = newton_steps(16) + 1
INVERSE_BLOCK = 8


def _block_inverse(a, npad: int, precision: str) -> jax.Array:
    """``X ~ (I + A)^-1`` for deep trees: the diagonal blocks of :data:`INVERSE_BLOCK` nodes by
    Newton-Schulz (``X_D``), the rest by block substitution ``X = X_D - M X`` with ``M = X_D L``
    (``L``: ``A`` off those blocks), iterated once per block a path of an ``npad``-node system
    can cross."""
    m = a.shape[0]
    bs = INVERSE_BLOCK
    same = (iota((m, m), 0) // bs) == (iota((m, m), 1) // bs)
    xd = newton_inverse(jnp.where(same, a, 0.0), newton_steps(bs), precision)
    sm = split(dot(xd, jnp.where(same, 0.0, a), precision), precision)

    def substitute(_, x):
        return xd - dot(sm, x, precision)

    return jax.lax.fori_loop(0, max(npad // bs - 1, 0), substitute, xd)


def solve(a, rhs, steps, blocks: TpuVerifyBlocks, npad: int | None = None) -> jax.Array:
    """``U = (I + A)^-1 R`` for the stacked strictly lower ``A (m, m)`` (module docstring);
    ``steps``: inverse steps for the deepest stacked tree (an int or a traced scalar);
    ``npad``: nodes of one stacked system (``m`` when not given)."""
    m = a.shape[0]
    npad = m if npad is None else npad
    inv_p = "bf16" if blocks.refine_steps else blocks.precision
    if blocks.inverse == "newton":
        eye = jnp.where(eye_mask(m), 1.0, 0.0).astype(F32)

        def double(_, xp):  # P <- P^2, X <- X (I + P): (I - A)(I + A^2)(I + A^4)...
            x, sp = xp  # P as its bf16 pieces, split once for the three dots that read it
            sp = split(dot(sp, sp, inv_p), inv_p)
            return x + dot(x, sp, inv_p), sp

        def shallow():
            x, _ = jax.lax.fori_loop(
                0, jnp.maximum(steps - 1, 0), double, (eye - a, split(a, inv_p))
            )
            # The last doubling as a Newton-Schulz step, X <- X + X (I - (I + A) X), which
            # also squares away the rounding the earlier products left.
            sx = split(x, inv_p)
            return x + dot(sx, eye - x - dot(a, sx, inv_p), inv_p)

        if npad <= 16:
            x = shallow()
        else:
            x = jax.lax.cond(steps >= DEEP_STEPS, lambda: _block_inverse(a, npad, inv_p), shallow)
        sx = split(x, inv_p)
        u = dot(sx, rhs, inv_p)
    else:
        bs = min(blocks.block, m)
        bd = (iota((m, m), 0) // bs) == (iota((m, m), 1) // bs)
        x = newton_inverse(jnp.where(bd, a, 0.0), newton_steps(bs), inv_p)
        rowblock = iota((m, 1), 0) // bs
        u = jnp.zeros_like(rhs)
        for i in range(m // bs):
            r = rhs - u - dot(a, u, blocks.precision)
            u = jnp.where(rowblock == i, dot(x, r, inv_p), u)
        sx = split(x, inv_p)
    if blocks.refine_steps:
        sa = split(a, blocks.precision)
        for _ in range(blocks.refine_steps):
            r = rhs - u - dot(sa, u, blocks.precision, mxu=blocks.mxu_rows)
            u = u + dot(sx, r, inv_p)
    return u


def _state_products(q, k, s0, blocks: TpuVerifyBlocks) -> list[jax.Array]:
    """``[k_i; q_i] S0_i`` of each stacked row ``i``, f32 ``(2 Npad, s V)`` (the ``s`` heads'
    states side by side): one dot per row, or, where ``r K`` fits the MXU's width
    (``mxu_rows``), one block-diagonal dot ``[r 2Npad, r K] x [r K, s V]`` for all rows: an MXU
    wider than ``K`` pads each row's contraction to its width, so the ``r`` rows cost as one."""
    r, npad, dk = k.shape
    kq = [jnp.concatenate([k[i], q[i]], axis=0) for i in range(r)]
    states = [jnp.concatenate(list(s0[i]), axis=1) for i in range(r)]
    if r == 1 or r * dk > blocks.mxu_rows:
        return [dot(kq[i], states[i], blocks.precision) for i in range(r)]
    zero = jnp.zeros_like(kq[0])
    lhs = jnp.concatenate(
        [jnp.concatenate([kq[i] if j == i else zero for j in range(r)], axis=1) for i in range(r)],
        axis=0,
    )
    p = dot(lhs, jnp.concatenate(states, axis=0), blocks.precision)
    return [p[2 * npad * i : 2 * npad * (i + 1)] for i in range(r)]


def _stacked_scales(cols: list[jax.Array], s: int) -> jax.Array:
    """Each row's ``(Npad, 1)`` scales repeated for its ``s`` stacked heads: ``(m, 1)``."""
    return jnp.concatenate([c for c in cols for _ in range(s)], axis=0)


def wy_math(q, k, v, g_row, beta, incl, s0, steps, *, npad, scale, use_l2norm, blocks):
    """The stacked WY systems of one program on values: raw ``q, k (r, Npad, K)``, ``v (r, s,
    Npad, V)``, the per-node ``g`` as a row ``(1, m)`` and ``beta`` as a column ``(m, 1)``, the
    block-diagonal inclusive ancestor mask ``incl (m, m)``, ``s0 (r, s, K, V)`` f32 and the
    inverse ``steps``; ``m = r s Npad``, systems ordered (row, head). Returns ``(o (m,
    V), u (m, V), G (m, 1), key row scales (m, 1))``, f32."""
    r, s, _, dv = v.shape
    m = r * s * npad
    prec = blocks.precision
    kst = jnp.concatenate([k[i] for i in range(r) for _ in range(s)], axis=0)  # (m, K)
    qst = jnp.concatenate([q[i] for i in range(r) for _ in range(s)], axis=0)
    rk = _stacked_scales([row_scales(k[i], use_l2norm) for i in range(r)], s)
    rq = _stacked_scales([row_scales(q[i], use_l2norm, scale) for i in range(r)], s)
    prods = dot(jnp.concatenate([kst, qst], axis=0), kst, prec, trans_b=True)  # (2m, m)

    g_path = jnp.sum(jnp.where(incl, g_row, 0.0), axis=1, keepdims=True)  # (m, 1)
    decay = masked_decay(g_path, to_row(g_path), incl)
    dk = decay * to_row(rk)  # D[n, i] / |k_i|
    strict = incl & jnp.logical_not(eye_mask(m))
    a = jnp.where(strict, prods[:m] * dk, 0.0) * (beta * rk)
    att = prods[m:] * dk * rq  # (Q K^T) * D

    ks, qs = [], []
    for p in _state_products(q, k, s0, blocks):  # (2 Npad, s V) per row
        for j in range(s):
            ks.append(p[:npad, j * dv : (j + 1) * dv])
            qs.append(p[npad:, j * dv : (j + 1) * dv])
    ks = jnp.concatenate(ks, axis=0) if len(ks) > 1 else ks[0]
    qs = jnp.concatenate(qs, axis=0) if len(qs) > 1 else qs[0]
    eg = jnp.exp(g_path)
    rhs = beta * (v.reshape(m, dv).astype(F32) - (eg * rk) * ks)
    u = solve(a, rhs, steps, blocks, npad)
    o = (eg * rq) * qs + dot(att, u, prec, mxu=blocks.mxu_rows)
    return o, u, g_path, rk


def _kernel(
    steps_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, anc_ref, s0_ref, o_ref, u_ref, gp_ref, **kw
):
    incl = anc_ref[...] > 0
    steps = steps_ref[pl.program_id(0)]
    o, u, g_path, _ = wy_math(
        q_ref[...],
        k_ref[...],
        v_ref[...],
        g_ref[...],
        beta_ref[...],
        incl,
        s0_ref[...],
        steps,
        **kw,
    )
    o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
    u_ref[...] = u.reshape(u_ref.shape)
    gp_ref[...] = to_row(g_path)


def ancestors(parents: jax.Array) -> jax.Array:
    """XLA: bool ``[B, N, N]`` inclusive ancestor masks from int32 parent ids (``ceil(log2
    N)`` squarings of ``I + onehot(parent)`` in bf16 with f32 sums: exact)."""
    n = parents.shape[-1]
    reach = (parents[..., :, None] == jnp.arange(n)) | jnp.eye(n, dtype=bool)
    for _ in range(max(n - 1, 1).bit_length()):
        x = reach.astype(BF16)
        reach = jnp.einsum("bij,bjk->bik", x, x, preferred_element_type=F32) > 0.5
    return reach


@dataclasses.dataclass(frozen=True)
class VerifyLaunch:
    """Head-major, padded, stacked verify operands and the facts the wrappers share."""

    q: jax.Array  # [B, Hk, Npad, K]
    k: jax.Array
    v: jax.Array  # [B, Hv, Npad, V]
    g: jax.Array  # f32 [B / r, Hv / s, 1, m]: g of the stacked nodes, a row
    beta: jax.Array  # f32 [B / r, Hv / s, m, 1]: beta, a column
    anc: jax.Array  # bf16 [B / r, m, m], block diagonal
    steps: jax.Array  # int32 [B / r]: inverse steps of each row group (its deepest tree)
    n: int
    npad: int
    r: int
    s: int
    grp: int
    scale: float

    @property
    def m(self) -> int:
        return self.r * self.s * self.npad


def prepare_verify(q, k, v, g, beta, parents, *, scale, blocks: TpuVerifyBlocks) -> VerifyLaunch:
    """Checks the verify inputs (ValueError naming the limit), pads ``N`` to a power of two
    >= 16 with padding nodes (parent -2, zero inputs), lays the operands out head-major and
    stacks the per-node rows and ancestor masks of each program's systems."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_max_nodes(n, MAX_NODES, "TPU tree_verify kernel")
    check_blocks(blocks, TpuVerifyBlocks)
    check_dims(q, k, v, hk=hk, hv=hv, dk=dk, dv=dv)
    npad = next_pow2(n, 16)
    grp = hv // hk
    r, s = blocks.stacking(b, grp, npad, dk, dv)
    q, k, v, g, beta = (pad_axis(x, 1, npad) for x in (q, k, v, g, beta))
    parents = pad_axis(parents.astype(jnp.int32), 1, npad, value=-2)
    m = r * s * npad

    def stacked(x):  # [B, Npad, Hv] -> [B / r, Hv / s, m] in (row, head, node) order
        x = head_major(x.astype(F32)).reshape(b // r, r, hv // s, s, npad)
        return x.transpose(0, 2, 1, 3, 4).reshape(b // r, hv // s, m)

    masks = ancestors(parents)
    depth = jnp.max(jnp.sum(masks, axis=2).reshape(b // r, r * npad), axis=1)
    steps = sum(
        (depth > (1 << j)).astype(jnp.int32) for j in range(1, max(npad - 1, 1).bit_length())
    )
    scale = default_scale(scale, dk)
    return VerifyLaunch(
        head_major(q),
        head_major(k),
        head_major(v),
        stacked(g)[:, :, None, :],
        stacked(beta)[:, :, :, None],
        _stack_masks(masks, r, s),
        jnp.asarray(steps, jnp.int32).reshape(b // r),
        n=n,
        npad=npad,
        r=r,
        s=s,
        grp=grp,
        scale=scale,
    )


def _stack_masks(masks: jax.Array, r: int, s: int) -> jax.Array:
    """bf16 ``[B / r, m, m]``: each group of ``r`` rows' ``[Npad, Npad]`` masks placed
    block-diagonally, each repeated for ``s`` heads, in (row, head, node) order."""
    b, npad, _ = masks.shape
    grouped = masks.reshape(b // r, r, 1, npad, 1, 1, npad)
    rows = jnp.eye(r, dtype=bool)[:, None, None, :, None, None]
    heads = jnp.eye(s, dtype=bool)[None, :, None, None, :, None]
    full = grouped & (rows & heads)[None]
    m = r * s * npad
    return full.reshape(b // r, m, m).astype(BF16)


def verify_specs(t: VerifyLaunch, dk: int, dv: int, index=lambda f: f):
    """Block specs of ``steps, q, k, v, g, beta, anc`` (inputs) and ``o, u, g_path`` (outputs)
    on the ``(row group, head group)`` grid; ``index`` adapts the index maps (scalar-prefetch
    grids pass extra refs)."""
    npad, r, s, grp, m = t.npad, t.r, t.s, t.grp, t.m

    def spec(shape, fn):
        return pl.BlockSpec(shape, index(fn))

    qk = spec((r, None, npad, dk), lambda i, c: (i, (c * s) // grp, 0, 0))
    vo = spec((r, s, npad, dv), lambda i, c: (i, c, 0, 0))
    row = spec((None, None, 1, m), lambda i, c: (i, c, 0, 0))
    col = spec((None, None, m, 1), lambda i, c: (i, c, 0, 0))
    anc = spec((None, m, m), lambda i, c: (i, 0, 0))
    steps = pl.BlockSpec(memory_space=pltpu.SMEM)
    return [steps, qk, qk, vo, row, col, anc], [vo, vo, row]


def verify_out_shape(t: VerifyLaunch, dv: int, o_dtype):
    b, hv = t.v.shape[0], t.v.shape[1]
    return [
        jax.ShapeDtypeStruct((b, hv, t.npad, dv), o_dtype),
        jax.ShapeDtypeStruct((b, hv, t.npad, dv), F32),
        jax.ShapeDtypeStruct((b // t.r, hv // t.s, 1, t.m), F32),
    ]


def verify_vmem(t: VerifyLaunch, dk: int, dv: int, in_dtype, o_dtype) -> int:
    """VMEM budget of one program: its blocks double-buffered and about 14 ``(m, m)`` and 12
    ``(m, V)`` f32 temporaries (products, masks, decays, the inverse and its pieces)."""
    npad, r, s, m = t.npad, t.r, t.s, t.m
    blocks = [
        ((r, npad, dk), in_dtype),
        ((r, npad, dk), in_dtype),
        ((r, s, npad, dv), in_dtype),
        ((1, m), F32),
        ((m, 1), F32),
        ((m, m), BF16),
        ((r, s, dk, dv), F32),
        ((r, s, npad, dv), o_dtype),
        ((r, s, npad, dv), F32),
        ((1, m), F32),
    ]
    temps = [((m, m), F32)] * 14 + [((m, dv), F32)] * 12 + [((2 * m, dk), F32)] * 2
    return vmem_bytes(blocks, temporaries=temps)


def finish_verify(t: VerifyLaunch, o, u, gp):
    """The kernel's head-major outputs back in the op's layout, cut to the real ``N``."""
    b, hv = o.shape[0], o.shape[1]
    gp = gp.reshape(b // t.r, hv // t.s, t.r, t.s, t.npad).transpose(0, 2, 1, 3, 4)
    gp = gp.reshape(b, hv, t.npad)
    o, u, gp = head_major(o), head_major(u), head_major(gp)
    return o[:, : t.n], u[:, : t.n], gp[:, : t.n]


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "blocks", "interpret"))
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
    blocks: TpuVerifyBlocks = DEFAULT_TPU_VERIFY_BLOCKS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree WY verify on a TPU. ``q, k [B, N, Hk, K]``, ``v [B, N, Hv, V]``, ``g, beta
    [B, N, Hv]``, ``parents`` int ``[B, N]``, ``initial_state`` f32 ``[B, Hv, K, V]``.

    Returns ``(o [B, N, Hv, V] in v's dtype, u f32 [B, N, Hv, V], g_path f32 [B, N, Hv])``, as
    :func:`pallas_kernels.tree_verify`. ``interpret=True`` runs TPU interpret mode (any
    backend)."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    t = prepare_verify(q, k, v, g, beta, parents, scale=scale, blocks=blocks)
    in_specs, out_specs = verify_specs(t, dk, dv)
    s0_spec = pl.BlockSpec((t.r, t.s, dk, dv), lambda i, c: (i, c, 0, 0))
    kernel = functools.partial(
        _kernel, npad=t.npad, scale=t.scale, use_l2norm=use_qk_l2norm, blocks=blocks
    )
    need = verify_vmem(t, dk, dv, q.dtype, v.dtype)
    o, u, gp = pl.pallas_call(
        kernel,
        grid=(b // t.r, hv // t.s),
        in_specs=[*in_specs, s0_spec],
        out_specs=out_specs,
        out_shape=verify_out_shape(t, dv, v.dtype),
        compiler_params=compiler_params("tree_verify", need, ("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="gdn_tree_verify_tpu",
    )(t.steps, t.q, t.k, t.v, t.g, t.beta, t.anc, initial_state.astype(F32))
    return finish_verify(t, o, u, gp)


@functools.partial(
    jax.jit, static_argnames=("state_offset", "scale", "use_qk_l2norm", "blocks", "interpret")
)
def tree_verify_arena(
    q,
    k,
    v,
    g,
    beta,
    parents,
    arena,
    table,
    handles,
    *,
    state_offset: int,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    blocks: TpuVerifyBlocks = DEFAULT_TPU_VERIFY_BLOCKS,
    interpret: bool = False,
):
    """:func:`tree_verify` with ``S0[b]`` read in place from the serving memory arena: the f32
    ``[Hv, K, V]`` state at word ``table[handles[b], 1] + state_offset`` of segment
    ``table[handles[b], 0]`` (:mod:`pallas_kernels.tpu._arena`: ``V == 128``, states on
    128-word rows; a handle ``< 0`` reads zeros). Returns ``(o, u, g_path)``."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    t = prepare_verify(q, k, v, g, beta, parents, scale=scale, blocks=blocks)
    r, s = t.r, t.s
    in_specs, out_specs = verify_specs(t, dk, dv, index=lambda f: lambda i, c, *_: f(i, c))

    def kernel(hd_ref, tab_ref, *refs):
        steps_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, anc_ref, ar_ref = refs[:8]
        o_ref, u_ref, gp_ref, buf = refs[8:]
        i, c = pl.program_id(0), pl.program_id(1)
        s0 = []
        for j in range(r):
            addr = state_rows(hd_ref, tab_ref, i * r + j, offset=state_offset, first_row=c * s * dk)
            s0.append(load_states(ar_ref, buf, addr, (s, dk, dv)))
        s0 = jnp.stack(s0) if r > 1 else s0[0][None]
        _kernel(
            steps_ref,
            q_ref,
            k_ref,
            v_ref,
            g_ref,
            beta_ref,
            anc_ref,
            Value(s0),
            o_ref,
            u_ref,
            gp_ref,
            npad=t.npad,
            scale=t.scale,
            use_l2norm=use_qk_l2norm,
            blocks=blocks,
        )

    need = verify_vmem(t, dk, dv, q.dtype, v.dtype)
    o, u, gp = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b // r, hv // s),
            in_specs=[*in_specs, any_spec()],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((s * dk, dv), jnp.uint32)],
        ),
        out_shape=verify_out_shape(t, dv, v.dtype),
        compiler_params=compiler_params("tree_verify_arena", need, ("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="gdn_tree_verify_arena_tpu",
    )(
        handles.astype(jnp.int32),
        table.astype(jnp.int32),
        t.steps,
        t.q,
        t.k,
        t.v,
        t.g,
        t.beta,
        t.anc,
        lane_rows(arena),
    )
    return finish_verify(t, o, u, gp)
