"""Tree WY verify of one GDN layer as one Mosaic GPU kernel (Hopper: TMA copies and ``wgmma``).

The contract of :func:`pallas_kernels.verify.tree_verify` (docs/design.md, "Verify: one
solve")::

    G = P g;  A[n, i] = beta_n exp(G_n - G_i) (k_n . k_i), i a strict ancestor of n
    U = (I + A)^-1 diag(beta) (V - diag(e^G) K S0)
    O = diag(e^G) Q S0 + ((Q K^T) * D) U

for bf16 ``q, k, v``, ``K, V`` in {64, 128} and ``N <= 64``. One program (one warpgroup) per
(batch row, value head) holds all ``V`` value columns, the ``N`` nodes padded to 64 (the
``wgmma`` rows). Before the kernel XLA forms each row's tree facts, shared by every head (and,
in a model step, every layer): the inclusive ancestor mask ``P`` (bf16 0/1), the path decays
``G = P g`` (f32 at HIGHEST precision, which is also the ``g_path`` output), the number of
product-doubling steps the tree's depth needs, and ``G`` and ``beta`` transposed so one TMA
brings a head's row. In the kernel, every product a ``wgmma`` with bf16 operands in swizzled
shared memory and f32 accumulators:

* TMA: the head's ``q``, ``k`` (key head ``h // (Hv // Hk)``), ``v`` tiles, ``P``, the ``G``
  and ``beta`` rows, and ``S0`` (f32) in 64-row pieces;
* the l2norm row scales of ``q`` and ``k`` from the bf16 tiles; ``q`` and ``k`` enter every
  product raw (bf16 x bf16 products are exact) and their scales are applied after;
* ``S0`` split into bf16 high and low halves: ``K S0`` and ``Q S0`` as two passes each;
  ``K K^T`` one pass;
* ``A`` and the masked decays elementwise in registers;
* ``T0 ~ (I + A)^-1`` by product doubling in one-pass bf16, as many doublings as the tree is
  deep (deeper than 16: the diagonal 8-node blocks so and the rest by block substitution, as
  :func:`pallas_kernels.verify.kernel.inverse_by_depth`); ``U0 = T0 rhs``; then ``refine_steps`` of iterative refinement
  ``U <- U + T0 (rhs - U - A U)`` with ``A U`` at bf16x3 (``A`` and ``U`` split in halves);
* ``O = diag(e^G) Q S0 + W U`` with ``W = (Q K^T) * D`` at bf16x3; ``U`` (f32) and ``O``
  (``v``'s dtype) leave by TMA.

The state phase asks for 193600 bytes of shared memory a block on the H200 (207936 with every
left product operand in shared memory, the default): one block per SM.

Off a compute capability 9.x GPU it runs only in Mosaic GPU's interpret mode
(``interpret=True``). That mode takes product operands from shared memory only and cannot
start an accumulator at a value, so it always runs the ``lhs_in_smem=True, acc_init=False``
build, the default; the other builds (left operands in registers, accumulators started at the
value added) lower and compile for the H200 but are checked by no run. Interpret mode also runs
each product synchronously, so it cannot show a buffer rewritten before the product reading it
retired: every product's result is read (which retires it) before its operands' buffers are
rewritten.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.state.types import AbstractRef, TransformedRef
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._wy import check_heads_dims, default_scale, pad_axis
from pallas_kernels.moe.mgpu import check_hopper
from pallas_kernels.verify.kernel import (
    DOUBLING_MAX_DEPTH,
    INVERSE_BLOCK,
    _doublings,
    ancestor_mask,
)

F32 = jnp.float32
BF16 = jnp.bfloat16
NP = 64  # nodes per program: the wgmma M
SWIZZLE = 128
L2NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MgpuVerifyBlocks:
    """Static knobs of :func:`tree_verify_mgpu`. ``refine_steps``: iterative-refinement steps
    after the bf16 inverse (0..4; each multiplies ``U``'s error by a few 1e-3);
    ``lhs_in_smem``: every left product operand stored to shared memory first (else the
    register ones stay in registers); ``acc_init``: products that add to a value start their
    accumulator at it (else the value is added after). Interpret mode runs
    ``lhs_in_smem=True, acc_init=False`` whatever these say (module docstring)."""

    refine_steps: int = 2
    lhs_in_smem: bool = True
    acc_init: bool = False

    def __post_init__(self):
        if not isinstance(self.refine_steps, int) or not 0 <= self.refine_steps <= 4:
            raise ValueError(f"refine_steps: an int in [0, 4], got {self.refine_steps!r}")


DEFAULT_MGPU_VERIFY_BLOCKS = MgpuVerifyBlocks()


def _tr(dtype):
    return (
        plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(SWIZZLE),
    )


def _mm(a, b, shape, init=None, acc_init=True):
    """``init + a @ b`` (or ``a @ b``) by wgmma into a fresh f32 accumulator; reading the
    accumulator retires the product. ``acc_init``: the accumulator starts at ``init``
    (``pl.run_state`` with ``plgpu.ACC.init``), else ``init`` is added after the product
    (interpret mode has no accumulator store)."""

    def body(acc):
        if isinstance(a, (list, tuple)):
            for x, y in zip(a, b, strict=True):
                plgpu.wgmma(acc, x, y)
        else:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    if init is None:
        return pl.run_scoped(body, plgpu.ACC(shape, F32))
    lhs_refs = all(_is_ref(x) for x in (a if isinstance(a, (list, tuple)) else [a]))
    if not acc_init or not lhs_refs:
        # (jax 0.11.2: ACC.init with a register left operand fails to lower, an f32 carry
        # arriving as bf16; so register operands add the start value after the product.)
        return init + pl.run_scoped(body, plgpu.ACC(shape, F32))
    return pl.run_state(lambda acc: body(acc))(plgpu.ACC.init(init))


def _is_ref(x):
    return isinstance(x, TransformedRef) or isinstance(getattr(x, "aval", None), AbstractRef)


def _split(x):
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    p_ref,
    gt_ref,
    bt_ref,
    it_ref,
    s0_ref,
    o_ref,
    u_ref,
    *,
    grp,
    scale,
    use_l2norm,
    refine_steps,
    dk,
    dv,
    acc_init,
    lhs_in_smem,
):
    mm = functools.partial(_mm, acc_init=acc_init)
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    hk = h // grp
    n = NP
    row_l = plgpu.Layout.WGMMA.reduce(1)
    col_l = plgpu.Layout.WGMMA.reduce(0)
    bf_tr, f_tr = _tr(BF16), _tr(F32)

    def iota(shape, d):
        return plgpu.broadcasted_iota(jnp.int32, shape, d, layout=plgpu.Layout.WGMMA)

    def rows(x, shape):  # [n] row vector -> [n, c]
        return lax.broadcast_in_dim(x, shape, [0])

    def cols(x, shape):  # [c] column vector -> [n, c]
        return lax.broadcast_in_dim(x, shape, [1])

    def row_scale(x_s, s):
        if not use_l2norm:
            return plgpu.layout_cast(jnp.full((n,), s, F32), row_l)
        x = x_s[...].astype(F32)
        return s * lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)

    def outer(q_s, k_s, v_s, p_s, g_s, bt_s, rk_s, bars):
        def s0_phase(s0f, sh, sl):
            srcs = [
                (q_ref.at[b, :, hk, :], q_s),
                (k_ref.at[b, :, hk, :], k_s),
                (v_ref.at[b, :, h, :], v_s),
                (p_ref.at[b], p_s),
                (gt_ref.at[b, h], g_s),
                (bt_ref.at[b, h], bt_s),
            ] + [(s0_ref.at[b, h, pl.ds(j * n, n), :], s0f.at[j]) for j in range(dk // n)]
            for i, (src, dst) in enumerate(srcs):
                plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
            plgpu.barrier_wait(bars.at[1])
            rk = row_scale(k_s, 1.0)
            rk_s[...] = rk
            for j in range(dk // n):  # the f32 state as bf16 hi + lo, 64 rows at a time
                plgpu.barrier_wait(bars.at[6 + j])
                hi, lo = _split(s0f[j])
                sh[pl.ds(j * n, n), :] = hi
                sl[pl.ds(j * n, n), :] = lo
            plgpu.commit_smem()
            plgpu.barrier_wait(bars.at[0])
            ks = mm((k_s, k_s), (sh, sl), (n, dv))
            qs = mm((q_s, q_s), (sh, sl), (n, dv))
            return rk, ks, qs

        rk, ks, qs = pl.run_scoped(
            s0_phase,
            plgpu.SMEM((dk // n, n, dv), F32, transforms=f_tr),
            plgpu.SMEM((dk, dv), BF16, transforms=bf_tr),
            plgpu.SMEM((dk, dv), BF16, transforms=bf_tr),
        )
        for i in range(2, 6):
            plgpu.barrier_wait(bars.at[i])
        rq = row_scale(q_s, scale)
        g_r = plgpu.load(g_s, layout=row_l)
        g_c = plgpu.load(g_s, layout=col_l)
        beta_r = plgpu.load(bt_s, layout=row_l)
        rk_c = plgpu.load(rk_s, layout=col_l)
        sq, sv = (n, n), (n, dv)
        eg = jnp.exp(g_r)
        rhs = rows(beta_r, sv) * (v_s[...].astype(F32) - rows(eg * rk, sv) * ks)
        qs = rows(eg * rq, sv) * qs

        incl = p_s[...].astype(F32) > 0.5
        strict = incl & (iota(sq, 0) != iota(sq, 1))
        diff = jnp.where(incl, rows(g_r, sq) - cols(g_c, sq), 0.0)
        decay = jnp.where(incl, jnp.exp(diff), 0.0)

        def solve(rhs_s, qs_s, pw, uh, ul, o_st, *lhs_bufs):
            ts, ah, al = lhs_bufs if lhs_bufs else (None, None, None)

            def lhs(x, buf):
                """A bf16 left operand: registers, or (lhs_in_smem) stored to ``buf``; the
                caller commits before the product."""
                if buf is None:
                    return x
                buf[...] = x
                return buf

            rhs_s[...] = rhs
            qs_s[...] = qs
            kk = mm(k_s, k_s.T, sq)
            a = jnp.where(strict, rows(beta_r * rk, sq) * cols(rk_c, sq) * decay * kk, 0.0)
            eye = jnp.where(iota(sq, 0) == iota(sq, 1), 1.0, 0.0)

            def double(_, tp):
                t, p = tp
                pw[...] = p.astype(BF16)
                plgpu.commit_smem()
                p = mm(pw, pw, sq)  # both operands from SMEM; retired: pw may be rewritten
                pw[...] = p.astype(BF16)
                tl = lhs(t.astype(BF16), ts)
                plgpu.commit_smem()
                t = mm(tl, pw, sq, init=t)
                return t, p

            # deep trees: the diagonal blocks by doubling, the rest by block substitution
            # (pallas_kernels.verify.kernel.inverse_by_depth)
            levels = it_ref[b, 1]
            shift = (INVERSE_BLOCK - 1).bit_length()
            same = (lax.shift_right_logical(iota(sq, 0), shift)) == (
                lax.shift_right_logical(iota(sq, 1), shift)
            )
            same = same | (levels == 0)
            d = jnp.where(same, a, 0.0)
            td, _ = lax.fori_loop(0, it_ref[b, 0], double, (eye - d, d))
            pw[...] = jnp.where(same, 0.0, a).astype(BF16)
            tdl = lhs(td.astype(BF16), ah)
            plgpu.commit_smem()
            m = lhs(mm(tdl, pw, sq).astype(BF16), al)  # M = T_D L; retired: pw is free

            def substitute(_, t):
                pw[...] = t.astype(BF16)
                plgpu.commit_smem()
                return td - mm(m, pw, sq)

            t = lax.fori_loop(0, levels, substitute, td)
            nah, nal = _split(-a)
            t0 = lhs(t.astype(BF16), ts)
            nah, nal = lhs(nah, ah), lhs(nal, al)
            uh[...] = rhs.astype(BF16)
            plgpu.commit_smem()
            u = mm(t0, uh, sv)
            for _ in range(refine_steps):
                hi, lo = _split(u)
                uh[...] = hi
                ul[...] = lo
                plgpu.commit_smem()
                r = mm((nah, nah, nal), (uh, ul, uh), sv, init=rhs_s[...] - u)
                uh[...] = r.astype(BF16)
                plgpu.commit_smem()
                u = mm(t0, uh, sv, init=u)

            hi, lo = _split(u)
            uh[...] = hi
            ul[...] = lo
            rhs_s[...] = u
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(rhs_s, u_ref.at[b, :, h, :])
            qk = mm(q_s, k_s.T, sq)
            w = qk * rows(rq, sq) * cols(rk_c, sq) * decay
            wh, wl = _split(w)
            wh, wl = lhs(wh, ah), lhs(wl, al)  # the refinement's products have retired
            plgpu.commit_smem()
            o = mm((wh, wh, wl), (uh, ul, uh), sv, init=qs_s[...])
            o_st[...] = o.astype(o_st.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_st, o_ref.at[b, :, h, :])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            solve,
            plgpu.SMEM((n, dv), F32, transforms=f_tr),
            plgpu.SMEM((n, dv), F32, transforms=f_tr),
            plgpu.SMEM((n, n), BF16, transforms=bf_tr),
            plgpu.SMEM((n, dv), BF16, transforms=bf_tr),
            plgpu.SMEM((n, dv), BF16, transforms=bf_tr),
            plgpu.SMEM((n, dv), o_ref.dtype, transforms=_tr(o_ref.dtype)),
            *([plgpu.SMEM((n, n), BF16, transforms=bf_tr)] * (3 if lhs_in_smem else 0)),
        )

    pl.run_scoped(
        outer,
        plgpu.SMEM((n, dk), BF16, transforms=bf_tr),
        plgpu.SMEM((n, dk), BF16, transforms=bf_tr),
        plgpu.SMEM((n, dv), BF16, transforms=bf_tr),
        plgpu.SMEM((n, n), BF16, transforms=bf_tr),
        plgpu.SMEM((n,), F32),
        plgpu.SMEM((n,), F32),
        plgpu.SMEM((n,), F32),
        plgpu.Barrier(num_barriers=6 + dk // NP),
    )


def tree_facts(parents, g, ancestors=None):
    """XLA: ``(P bf16 [B, 64, 64], G f32 [B, 64, Hv], steps int32 [B, 2])`` of the padded
    parents ``[B, 64]`` and ``g [B, 64, Hv]``; ``steps``: the inverse's doublings and its
    block-substitution levels (:func:`pallas_kernels.verify.kernel.inverse_by_depth`)."""
    incl = ancestor_mask(parents) if ancestors is None else ancestors
    pf = incl.astype(F32)
    gp = jnp.einsum("bni,bih->bnh", pf, g.astype(F32), precision=lax.Precision.HIGHEST)
    depth = jnp.max(jnp.sum(pf, axis=2), axis=1).astype(jnp.int32)
    deep = depth > DOUBLING_MAX_DEPTH
    block_depth = jnp.where(deep, jnp.minimum(depth, INVERSE_BLOCK), depth)
    levels = jnp.where(deep, jnp.minimum(depth - 1, NP // INVERSE_BLOCK - 1), 0)
    steps = jnp.stack([_doublings(block_depth, NP), levels], axis=1)
    return incl.astype(BF16), gp, steps.astype(jnp.int32)


def check_verify_mgpu(q, k, v, initial_state, interpret: bool) -> None:
    """``ValueError`` naming the argument for inputs (or a machine) the kernel cannot take."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_heads_dims(q, k, v, hk=hk, dk=dk, hv=hv, dv=dv)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != BF16:
            raise ValueError(f"{name}: the Mosaic GPU tree verify takes bfloat16, got {x.dtype}")
    if n > NP:
        raise ValueError(f"q: the Mosaic GPU tree verify takes at most {NP} nodes, got {n}")
    if dk not in (64, 128) or dv not in (64, 128):
        raise ValueError(
            f"k, v: the Mosaic GPU tree verify takes K, V of 64 or 128, got {dk}, {dv}"
        )
    if initial_state.shape != (b, hv, dk, dv):
        raise ValueError(
            f"initial_state: expected [B, Hv, K, V] = {(b, hv, dk, dv)}, got {initial_state.shape}"
        )
    check_hopper("the Mosaic GPU tree verify", interpret)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "blocks", "interpret"))
def tree_verify_mgpu(
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
    blocks: MgpuVerifyBlocks = DEFAULT_MGPU_VERIFY_BLOCKS,
    ancestors: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree WY verify (module docstring): the arguments and outputs of
    :func:`pallas_kernels.verify.tree_verify` (``ancestors``: the inclusive ancestor mask of
    ``parents``, computed here when not given), for bf16 ``q, k, v``, ``K, V`` in {64, 128},
    ``N <= 64``. Raises ``ValueError`` before launching for inputs the kernel cannot take, and
    off a Hopper GPU unless ``interpret``."""
    check_verify_mgpu(q, k, v, initial_state, interpret)
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = default_scale(scale, dk)
    q, k, v = (pad_axis(x, 1, NP) for x in (q, k, v))
    g, beta = (pad_axis(x.astype(F32), 1, NP) for x in (g, beta))
    parents = pad_axis(parents.astype(jnp.int32), 1, NP, value=-2)
    if ancestors is not None:
        pad = NP - ancestors.shape[-1]
        ancestors = jnp.pad(ancestors.astype(bool), ((0, 0), (0, pad), (0, pad)))
        ancestors = ancestors | jnp.eye(NP, dtype=bool)  # a padding node is its own ancestor
    pb, gp, iters = tree_facts(parents, g, ancestors)
    gt, bt = gp.transpose(0, 2, 1), beta.transpose(0, 2, 1)
    kernel = functools.partial(
        _kernel,
        grp=hv // hk,
        scale=scale,
        use_l2norm=use_qk_l2norm,
        refine_steps=blocks.refine_steps,
        dk=dk,
        dv=dv,
        acc_init=blocks.acc_init and not interpret,
        lhs_in_smem=interpret or blocks.lhs_in_smem,
    )
    o, u = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((b, NP, hv, dv), v.dtype),
            jax.ShapeDtypeStruct((b, NP, hv, dv), F32),
        ),
        grid=(b, hv),
        grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )(q, k, v, pb, gt, bt, iters, initial_state.astype(F32))
    return o[:, :n], u[:, :n], gp[:, :n]
