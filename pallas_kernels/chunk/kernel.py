"""Chunked prefill of the gated delta rule as three Pallas kernels (chunk 64 on the H200).

Only the state recurrence is sequential; the in-chunk solve and the outputs run in parallel over
(chunk, value head), as in flash-linear-attention's chunk pipeline. Per chunk of ``C`` tokens
with in-chunk cumulative log decay ``Gc`` and incoming state ``S`` (the tree WY verify of a
chain, docs/design.md)::

    A[i, j] = beta_i exp(Gc_i - Gc_j) k_i . k_j   (j < i),     T = (I + A)^-1
    W  = T diag(beta e^Gc) K,   Uv = T diag(beta) V            kernel 1, parallel ("intra")
    U  = Uv - W S;   h_c = S                                    kernel 2, sequential ("state")
    S <- e^{Gc_last} S + (K * e^{Gc_last - Gc})^T U
    O  = diag(e^Gc) Q S_c + ((Q K^T) * D) U,                    kernel 3, parallel ("out")
         D[i, j] = exp(Gc_i - Gc_j) for j <= i

Kernel 1 builds ``T`` in ``sub x sub`` blocks (16 by default): diagonal blocks of ``I + A`` are
inverted by product doubling (``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...``, exact since ``A`` is
nilpotent), off-diagonal blocks by ``T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj``; ``W`` and ``Uv``
are then row-block sums of ``T_ij`` times the raw ``K_j``/``V_j`` rows. ``sub = C`` is the plain
dense product doubling on ``C x C``.

Grids and buffers (``NC`` chunk slots; defaults of :class:`ChunkBlocks`)::

    intra (NC, Hv)                    -> W [NC, Hv, C, K], Uv [NC, Hv, C, V], Gc, rk [NC, Hv, C]
    state (S, Hv, V / block_v_state)  -> U [NC, Hv, C, V], h [NC, Hv, K, V], final [S, Hv, K, V]
    out   (NC, Hv, V / block_v_out)   -> o [T, Hv, V]

All intermediates are f32 (``h`` optionally bf16: ``h_bf16``; ``U`` optionally bf16: ``u_bf16``);
``rk`` are the key rows' l2norm scales (ones without the l2norm). Shared memory at chunk 64,
K = V = 128, bf16 inputs, default blocks (Triton 3.6 for sm_90 on the lowered modules): intra
12 KiB, state 80.5 KiB (2 pipeline stages), out 24 KiB, against 227 KiB per block
(``benchmarks/compile_report.py --kernel chunk`` for other blocks).

``store_t`` (off by default) moves the right-hand sides out of kernel 1: it stores only
``Tb = T diag(beta)`` ``[NC, Hv, C, C]`` (plus ``Gc``, ``rk``), and kernel 2 forms
``U = Tb (V - diag(e^Gc rk) K S)`` (the same ``U = Uv - W S``), reading raw ``V`` and ``K``.
That replaces the 2 C (K + V)-float ``W``/``Uv`` round trip through HBM by a C^2-float one (a
quarter at C 64, K = V 128) and drops the ``W``/``Uv`` dots from kernel 1, for one more dot
(``Tb R``, C x C x block_v_state) on the state kernel's serial path.

``fuse_out`` (off by default) drops kernel 3: kernel 2 also writes ``O`` for its value
columns as it passes each chunk (``Q S_c`` with the f32 state, ``Q K^T`` and the decay mask
recomputed by each of the ``V / block_v_state`` programs of a head), so ``U`` and ``h`` never
reach HBM; ``h_bf16``, ``u_bf16``, ``block_v_out`` and ``warps_out`` then do nothing.

Packed sequences (``cu_seqlens``): chunks never cross a sequence boundary; a small XLA prologue
(:func:`chunk_plan`) maps every chunk slot to its first token and length (slots past the last
chunk are empty and do nothing) and every sequence to its first slot and chunk count. The last
chunk of a sequence is read under a mask (masked rows have ``k = v = beta = g = 0``: they change
nothing).

Dots. ``ChunkBlocks.precision`` sets every dot between f32 values: ``"tf32x3"`` (3 tf32 tensor
core passes, f32-level accuracy; interpret mode on CPU runs IEEE f32), ``"bf16x3"`` (both
operands split into bf16 hi + lo, 3 bf16 passes, ~2^-17 relative per operand), ``"highest"``
(IEEE f32 FMAs, slow), ``"bf16"`` (one bf16 pass, ~3 significant digits, what fla does) or
``"auto"`` (the default: ``"bf16x3"`` when q, k and v are bf16, else ``"tf32x3"``). With
``exact_bf16_inputs`` (default) and bf16 ``q``/``k``, the dots that read the raw inputs keep them
unrounded: ``K K^T`` and ``Q K^T`` run as one bf16 pass (exact products, f32 accumulation);
``T K``, ``T V`` (bf16 v), ``Q S`` and ``K^T U`` split only their f32 operand, into 3 bf16
pieces for tf32x3/highest (f32-level), 2 for bf16x3, 1 for bf16. The l2norm and ``scale`` are
applied as row/column scales of the products.

Measured in interpret mode (CPU), T 1024, K = V = 128, bf16 q/k/v, l2norm, against the f32 XLA
path: precision auto (bf16x3) final state 3.7e-6, o 1.5e-4 (bf16 output rounding); with
``h_bf16`` o 9e-4; precision "bf16" state 2.4e-3, o 3.6e-3. T 150, K = V = 32 (same inputs
otherwise): ``h_bf16`` o 8.0e-4, state 3.8e-6; with ``store_t`` o 8.1e-4, state 5.4e-6;
``fuse_out`` (f32 ``Q S``) o 1.6e-4 (1.3e-4 with ``store_t``); ``u_bf16`` o 2.7e-3.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _fit as fit

F32 = jnp.float32
BF16 = jnp.bfloat16
L2NORM_EPS = 1e-6
PRECISIONS = ("auto", "tf32x3", "bf16x3", "highest", "bf16")
_PIECES = {"tf32x3": 3, "highest": 3, "bf16x3": 2, "bf16": 1}
_FLOATS = (jnp.dtype(F32), jnp.dtype(BF16), jnp.dtype(jnp.float16))
MAX_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
    """Static knobs of the three-kernel prefill.

    ``sub``: diagonal block size of the in-chunk solve (16, 32 or 64; capped at the chunk).
    ``block_k``: key-dimension block of the state and output kernels' dots (capped at K).
    ``block_v_state`` / ``block_v_out``: value columns per program of the state / output kernel.
    ``warps_*``: Triton warps of each kernel; ``stages_state``: Triton pipelining stages of the
    state kernel's loop over chunks. ``precision`` (``"auto"``: ``"bf16x3"`` when q, k and v are
    all bf16, else ``"tf32x3"``), ``exact_bf16_inputs``: see the module docstring. ``h_bf16``:
    store the per-chunk states in bf16 (half their HBM traffic; the inter-chunk part of ``O``
    then carries bf16 rounding, 4e-4 relative on an f32 ``o`` at T 1024; the recurrence itself
    stays f32). ``u_bf16``: store ``U`` in bf16 for the output kernel (half its HBM traffic;
    the intra-chunk part of ``O`` carries the rounding; the recurrence keeps f32 ``U``; the
    output kernel's ``((Q K^T) * D) U`` dot then splits only its f32 operand). ``store_t``: kernel
    1 stores ``T diag(beta)`` and kernel 2 applies it (module docstring); same results to
    rounding. ``fuse_out``: kernel 2 writes the outputs (no kernel 3; module docstring).
    """

    sub: int = 16
    block_k: int = 64
    block_v_state: int = 32
    block_v_out: int = 64
    warps_intra: int = 4
    warps_state: int = 4
    warps_out: int = 4
    stages_state: int = 2
    precision: str = "auto"
    exact_bf16_inputs: bool = True
    h_bf16: bool = False
    u_bf16: bool = False
    store_t: bool = False
    fuse_out: bool = False


DEFAULT_CHUNK_BLOCKS = ChunkBlocks()


# ---------------------------------------------------------------------------------------------
# In-kernel helpers (values already loaded; every array 1-D or 2-D with power-of-two sides)


def _split_bf16(x: jax.Array, n: int) -> list[jax.Array]:
    """``x`` (f32) as ``n`` bf16 pieces, largest first, whose f32 sum approximates ``x``."""
    pieces, r = [], x
    for i in range(n):
        p = r.astype(BF16)
        pieces.append(p)
        if i + 1 < n:
            r = r - p.astype(F32)
    return pieces


def _mm(a, b, ta=False, tb=False, precision=None):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


@dataclasses.dataclass(frozen=True)
class _Dots:
    """The kernels' dots at the configured precision. ``ff``: f32 x f32. ``rf``/``fr``: a raw
    input operand (``q`` or ``k`` as loaded) with an f32 one. ``rr``: two raw input operands."""

    precision: str
    interpret: bool
    exact: bool  # raw q/k are bf16 and exact_bf16_inputs is on

    def ff(self, a, b, ta=False, tb=False):
        a, b = a.astype(F32), b.astype(F32)
        if self.precision == "bf16":
            return _mm(a.astype(BF16), b.astype(BF16), ta, tb)
        if self.precision == "bf16x3":
            a_hi, a_lo = _split_bf16(a, 2)
            b_hi, b_lo = _split_bf16(b, 2)
            return _mm(a_lo, b_hi, ta, tb) + _mm(a_hi, b_lo, ta, tb) + _mm(a_hi, b_hi, ta, tb)
        if self.precision == "highest" or self.interpret:
            return _mm(a, b, ta, tb, jax.lax.Precision.HIGHEST)
        return _mm(a, b, ta, tb, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)

    def rf(self, raw, f, ta=False, tb=False):
        """``raw @ f``: a raw bf16 operand against an f32 one split into bf16 pieces."""
        return self._split(raw, f, ta, tb, raw_left=True)

    def fr(self, f, raw, ta=False, tb=False):
        """``f @ raw``, the mirror of :meth:`rf`."""
        return self._split(raw, f, ta, tb, raw_left=False)

    def _split(self, raw, f, ta, tb, *, raw_left: bool):
        if not self.exact:
            return self.ff(raw, f, ta, tb) if raw_left else self.ff(f, raw, ta, tb)
        out = None
        for p in reversed(_split_bf16(f.astype(F32), _PIECES[self.precision])):  # smallest first
            d = _mm(raw, p, ta, tb) if raw_left else _mm(p, raw, ta, tb)
            out = d if out is None else out + d
        return out

    def rr(self, a, b, ta=False, tb=False):
        if not self.exact:
            return self.ff(a, b, ta, tb)
        return _mm(a, b, ta, tb)


def _masked_decay(gi, gj, mask):
    """``where(mask, exp(gi - gj), 0)`` with the difference masked before ``exp``."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, gi - gj, 0.0)), 0.0)


def _row_scale(x, use_l2norm: bool):
    """``rsqrt(sum(x^2) + eps)`` per row (f32) or ``None`` without the l2norm."""
    if not use_l2norm:
        return None
    xf = x.astype(F32)
    return jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1) + L2NORM_EPS)


def _unit_lower_inverse(a, dots: _Dots):
    """``(I + A)^-1`` for strictly lower ``A [n, n]`` by product doubling (2 log2 n - 1 dots)."""
    n = a.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    t = jnp.where(row == col, 1.0, 0.0) - a
    p = a
    for _ in range(max(n - 1, 1).bit_length() - 1):
        p = dots.ff(p, p)
        t = t + dots.ff(t, p)
    return t


def _load_rows(ref, t0, n_rows, valid, other=0.0):
    """Rows ``[t0, t0 + n_rows)`` of a ``[T, D]`` or ``[T]`` ref; rows with ``valid`` False read
    ``other``."""
    mask = (
        valid
        if len(ref.shape) == 1
        else jnp.broadcast_to(valid[:, None], (n_rows,) + ref.shape[1:])
    )
    return plt.load(ref.at[pl.ds(t0, n_rows)], mask=mask, other=other)


def _load_cols(ref, t0, n_rows, c0, n_cols, valid):
    """Rows ``[t0, t0 + n_rows)``, columns ``[c0, c0 + n_cols)`` of a ``[T, D]`` ref (masked
    rows read 0)."""
    mask = jnp.broadcast_to(valid[:, None], (n_rows, n_cols))
    return plt.load(ref.at[pl.ds(t0, n_rows), pl.ds(c0, n_cols)], mask=mask, other=0.0)


# ---------------------------------------------------------------------------------------------
# Kernels


def _intra_kernel(*refs, names, chunk, sub, use_l2norm, dots, exact_v):
    """Kernel 1, one program per (chunk slot, value head): ``Gc``, the key row scales ``rk``
    (l2norm; ones without it), ``W`` and ``Uv`` of the chunk (with ``store_t``, refs named
    ``tb`` instead of ``w, uv``, and no ``v``: ``T diag(beta)``).

    ``T = (I + A)^-1`` is built in ``sub x sub`` blocks: diagonal blocks by product doubling,
    off-diagonal ones by ``T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj``; then
    ``W_i = sum_j (T_ij diag(beta e^Gc rk)_j) K_j`` and ``Uv_i = sum_j (T_ij diag(beta)_j) V_j``
    read the raw ``K``/``V`` rows (exact when they are bf16 and ``exact_bf16_inputs`` is on).
    """
    ref = dict(zip(names, refs, strict=True))
    start_ref, len_ref, k_ref, g_ref, beta_ref = (
        ref[x] for x in ("start", "len", "k", "g", "beta")
    )
    gc_ref, rk_ref = ref["gc"], ref["rk"]
    c = pl.program_id(0)
    t0, n = start_ref[c], len_ref[c]
    nb = chunk // sub
    pos = jax.lax.broadcasted_iota(jnp.int32, (sub,), 0)
    row = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    strict = row > col

    ks, rks, gcs, betas = [], [], [], []
    off = jnp.zeros((), F32)
    for i in range(nb):
        valid = pos + i * sub < n
        ti = t0 + i * sub
        k_i = _load_rows(k_ref, ti, sub, valid)
        g_i = _load_rows(g_ref, ti, sub, valid).astype(F32)
        b_i = _load_rows(beta_ref, ti, sub, valid).astype(F32)
        rk = _row_scale(k_i, use_l2norm)
        rk = jnp.ones((sub,), F32) if rk is None else rk
        gc_i = jnp.cumsum(g_i) + off
        off = off + jnp.sum(g_i)
        gc_ref[pl.ds(i * sub, sub)] = gc_i
        rk_ref[pl.ds(i * sub, sub)] = rk
        ks.append(k_i)
        rks.append(rk)
        gcs.append(gc_i)
        betas.append(b_i)

    # A in sub x sub blocks (j <= i); the l2norm scales rows and columns of the raw K K^T.
    a = {}
    for i in range(nb):
        for j in range(i + 1):
            kk = dots.rr(ks[i], ks[j], tb=True)
            if i == j:
                decay = _masked_decay(gcs[i][:, None], gcs[j][None, :], strict)
            else:
                decay = jnp.exp(gcs[i][:, None] - gcs[j][None, :])
            a[i, j] = (betas[i] * rks[i])[:, None] * decay * kk * rks[j][None, :]

    # T = (I + A)^-1 in blocks, by diagonals.
    t = {(i, i): _unit_lower_inverse(a[i, i], dots) for i in range(nb)}
    for d in range(1, nb):
        for i in range(d, nb):
            j = i - d
            acc = None
            for m in range(j, i):
                term = dots.ff(a[i, m], t[m, j])
                acc = term if acc is None else acc + term
            t[i, j] = -dots.ff(t[i, i], acc)

    if "tb" in ref:  # store_t: T diag(beta), upper blocks zero
        tb_ref = ref["tb"]
        for i in range(nb):
            for j in range(nb):
                blk = t[i, j] * betas[j][None, :] if j <= i else jnp.zeros((sub, sub), F32)
                tb_ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)] = blk
        return

    # W and Uv by row blocks; V is reloaded per use to keep the live set small.
    v_ref, w_ref, uv_ref = ref["v"], ref["w"], ref["uv"]
    for i in range(nb):
        w_i = uv_i = None
        for j in range(i + 1):
            sk = betas[j] * jnp.exp(gcs[j]) * rks[j]
            term = dots.fr(t[i, j] * sk[None, :], ks[j])
            w_i = term if w_i is None else w_i + term
            v_j = _load_rows(v_ref, t0 + j * sub, sub, pos + j * sub < n)
            vdot = dots.fr if exact_v else dots.ff
            term = vdot(t[i, j] * betas[j][None, :], v_j)
            uv_i = term if uv_i is None else uv_i + term
        w_ref[pl.ds(i * sub, sub), :] = w_i
        uv_ref[pl.ds(i * sub, sub), :] = uv_i


def _state_kernel(*refs, names, chunk, block_k, dots, scale, use_l2norm):
    """Kernel 2, one program per (sequence, value head, value-column block): the recurrence over
    the sequence's chunks, the state held as ``K / block_k`` row blocks. Stores ``U`` and the
    state entering every chunk; per chunk ``U = Uv - W S`` and ``S <- e^g S + K^T X``. With
    ``store_t`` (refs ``v, tb`` instead of ``w, uv``) ``U = Tb (V - diag(e^Gc rk) (K S))``. With
    ``fuse_out`` (ref ``q`` in, ``o`` out instead of ``u, h``) it also writes the chunk's
    outputs, as kernel 3 would: ``O = diag(rq e^Gc) Q S + ((Q K^T) * D) U`` (scales applied)."""
    ref = dict(zip(names, refs, strict=True))
    cs_ref, nch_ref, start_ref, len_ref, k_ref = (
        ref[x] for x in ("cs", "nch", "start", "len", "k")
    )
    gc_ref, rk_ref, s0_ref, sf_ref = ref["gc"], ref["rk"], ref["s0"], ref["sf"]
    store_t, fuse = "tb" in ref, "o" in ref
    if store_t:
        v_ref, tb_ref = ref["v"], ref["tb"]
    else:
        w_ref, uv_ref = ref["w"], ref["uv"]
    if fuse:
        q_ref, o_ref = ref["q"], ref["o"]
    else:
        u_ref, h_ref = ref["u"], ref["h"]
    seq = pl.program_id(0)
    c0, n_chunks = cs_ref[seq], nch_ref[seq]
    pos = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    nk = s0_ref.shape[0] // block_k

    def body(i, s):
        c = c0 + i
        t0, n = start_ref[c], len_ref[c]
        wu = None
        for r in range(nk):
            h_ref[c, pl.ds(r * block_k, block_k), :] = s[r].astype(h_ref.dtype)
            term = dots.ff(w_ref[c, :, pl.ds(r * block_k, block_k)], s[r])
            wu = term if wu is None else wu + term
        u = uv_ref[c] - wu
        u_ref[c] = u.astype(u_ref.dtype)
        gc = gc_ref[c]
        g_last = gc_ref[c, chunk - 1]
        x = (rk_ref[c] * jnp.exp(g_last - gc))[:, None] * u
        decay = jnp.exp(g_last)
        valid = pos < n
        out = []
        for r in range(nk):
            k_r = _load_cols(k_ref, t0, chunk, r * block_k, block_k, valid)
            out.append(decay * s[r] + dots.rf(k_r, x, ta=True))
        return tuple(out)

    def body_opt(i, s):
        """The step with ``store_t`` and / or ``fuse_out``; ``K`` tiles loaded once per chunk."""
        c = c0 + i
        t0, n = start_ref[c], len_ref[c]
        valid = pos < n
        gc, rk = gc_ref[c], rk_ref[c]
        k_t = [_load_cols(k_ref, t0, chunk, r * block_k, block_k, valid) for r in range(nk)]
        acc = qs = None
        for r in range(nk):
            if not fuse:
                h_ref[c, pl.ds(r * block_k, block_k), :] = s[r].astype(h_ref.dtype)
            if store_t:
                term = dots.rf(k_t[r], s[r])
            else:
                term = dots.ff(w_ref[c, :, pl.ds(r * block_k, block_k)], s[r])
            acc = term if acc is None else acc + term
            if fuse:  # Q S_c, the inter-chunk part of O
                q_r = _load_cols(q_ref, t0, chunk, r * block_k, block_k, valid)
                term = dots.rf(q_r, s[r])
                qs = term if qs is None else qs + term
        if store_t:
            v_c = _load_rows(v_ref, t0, chunk, valid).astype(F32)
            u = dots.ff(tb_ref[c], v_c - (rk * jnp.exp(gc))[:, None] * acc)
        else:
            u = uv_ref[c] - acc
        if not fuse:
            u_ref[c] = u.astype(u_ref.dtype)
        g_last = gc_ref[c, chunk - 1]
        x = (rk * jnp.exp(g_last - gc))[:, None] * u
        decay = jnp.exp(g_last)
        s_new = tuple(decay * s[r] + dots.rf(k_t[r], x, ta=True) for r in range(nk))
        if fuse:  # the intra-chunk part, q and k reloaded (cache hits) to keep the live set small
            qk = ssq = None
            for r in range(nk):
                q_r = _load_cols(q_ref, t0, chunk, r * block_k, block_k, valid)
                k_r = _load_cols(k_ref, t0, chunk, r * block_k, block_k, valid)
                term = dots.rr(q_r, k_r, tb=True)
                qk = term if qk is None else qk + term
                if use_l2norm:
                    qf = q_r.astype(F32)
                    term = jnp.sum(qf * qf, axis=-1)
                    ssq = term if ssq is None else ssq + term
            rq = (
                scale * jax.lax.rsqrt(ssq + L2NORM_EPS)
                if use_l2norm
                else jnp.full((chunk,), scale, F32)
            )
            row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
            col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
            decay_m = _masked_decay(gc[:, None], gc[None, :], row >= col)
            att = rq[:, None] * qk * rk[None, :] * decay_m
            o = (rq * jnp.exp(gc))[:, None] * qs + dots.ff(att, u)
            mask = jnp.broadcast_to(valid[:, None], o.shape)
            plt.store(o_ref.at[pl.ds(t0, chunk)], o.astype(o_ref.dtype), mask=mask)
        return s_new

    s0 = tuple(s0_ref[pl.ds(r * block_k, block_k), :].astype(F32) for r in range(nk))
    s = jax.lax.fori_loop(0, n_chunks, body_opt if store_t or fuse else body, s0)
    for r in range(nk):
        sf_ref[pl.ds(r * block_k, block_k), :] = s[r]


def _out_kernel(
    start_ref,
    len_ref,
    q_ref,
    k_ref,
    gc_ref,
    rk_ref,
    u_ref,
    h_ref,
    o_ref,
    *,
    chunk,
    block_k,
    scale,
    use_l2norm,
    dots,
):
    """Kernel 3, one program per (chunk slot, value head, value-column block):
    ``O = diag(e^Gc) Q S + ((Q K^T) * D) U``, the key dimension in ``block_k`` column blocks."""
    c = pl.program_id(0)
    t0, n = start_ref[c], len_ref[c]
    pos = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    valid = pos < n
    qk = qs = ssq = None
    for r in range(h_ref.shape[0] // block_k):
        q_r = _load_cols(q_ref, t0, chunk, r * block_k, block_k, valid)
        k_r = _load_cols(k_ref, t0, chunk, r * block_k, block_k, valid)
        s_r = h_ref[pl.ds(r * block_k, block_k), :]
        t_qk = dots.rr(q_r, k_r, tb=True)
        t_qs = dots.rr(q_r, s_r) if s_r.dtype == BF16 else dots.rf(q_r, s_r)
        qk = t_qk if qk is None else qk + t_qk
        qs = t_qs if qs is None else qs + t_qs
        if use_l2norm:
            qf = q_r.astype(F32)
            t_ssq = jnp.sum(qf * qf, axis=-1)
            ssq = t_ssq if ssq is None else ssq + t_ssq
    rq = scale * jax.lax.rsqrt(ssq + L2NORM_EPS) if use_l2norm else jnp.full((chunk,), scale, F32)
    gc = gc_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    decay = _masked_decay(gc[:, None], gc[None, :], row >= col)
    att = rq[:, None] * qk * rk_ref[...][None, :] * decay
    o = (rq * jnp.exp(gc))[:, None] * qs
    u = u_ref[...]
    o = o + (dots.fr(att, u) if u.dtype == BF16 else dots.ff(att, u))
    mask = jnp.broadcast_to(valid[:, None], o.shape)
    plt.store(o_ref.at[pl.ds(t0, chunk)], o.astype(o_ref.dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Wrapper


def _pow2(name: str, size: int, lo: int, hi: int) -> None:
    if size < lo or size > hi or size & (size - 1):
        raise ValueError(
            f"{name}: the chunk kernels need a power of two in [{lo}, {hi}], got {size}"
        )


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, blocks):
    if k.ndim != 4:
        raise ValueError(f"k: expected rank 4 [B, T, Hk, K], got shape {k.shape}")
    b, t, hk, dk = k.shape
    if q.shape != k.shape:
        raise ValueError(f"q: shape {q.shape} must equal k's shape {k.shape} [B, T, Hk, K]")
    if v.ndim != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"v: expected [B={b}, T={t}, Hv, V], got shape {v.shape}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"v: value heads Hv={hv} must be a multiple of key heads Hk={hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name}: expected shape [B, T, Hv] = {(b, t, hv)}, got {x.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if jnp.dtype(x.dtype) not in _FLOATS:
            raise ValueError(
                f"{name}: the chunk kernels accept float32, bfloat16 or float16, got {x.dtype}"
            )
    _pow2("K", dk, 16, 256)
    _pow2("V", dv, 16, 256)
    _pow2("chunk_size", chunk_size, 16, MAX_CHUNK)
    if blocks.precision not in PRECISIONS:
        raise ValueError(f"blocks.precision: one of {PRECISIONS}, got {blocks.precision!r}")
    _pow2("blocks.sub", blocks.sub, 16, MAX_CHUNK)
    _pow2("blocks.block_k", blocks.block_k, 16, 256)
    _pow2("blocks.block_v_state", blocks.block_v_state, 16, 256)
    _pow2("blocks.block_v_out", blocks.block_v_out, 16, 256)
    if cu_seqlens is None:
        n_seq = b
    else:
        if b != 1:
            raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={b}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(
                f"cu_seqlens: expected a 1-D array of S+1 >= 2 offsets, got {cu_seqlens.shape}"
            )
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens: must be integer, got {cu_seqlens.dtype}")
        n_seq = cu_seqlens.shape[0] - 1
        if not isinstance(cu_seqlens, jax.core.Tracer):
            import numpy as np

            cu = np.asarray(cu_seqlens)
            if cu[0] != 0 or cu[-1] != t:
                raise ValueError(
                    f"cu_seqlens: must start at 0 and end at T={t}, got {cu[0]}..{cu[-1]}"
                )
            if (cu[1:] < cu[:-1]).any():
                raise ValueError("cu_seqlens: offsets must be non-decreasing")
    if initial_state is not None and initial_state.shape != (n_seq, hv, dk, dv):
        raise ValueError(
            f"initial_state: expected shape [{'S' if cu_seqlens is not None else 'B'}, Hv, K, V] = "
            f"{(n_seq, hv, dk, dv)}, got {initial_state.shape}"
        )
    return n_seq


def chunk_plan(cu: jax.Array, chunk: int, n_slots: int):
    """Chunk slots of packed sequences ``cu [S + 1]`` (traced is fine).

    Returns int32 ``start [n_slots]`` (first token), ``length [n_slots]`` (0 for unused slots),
    ``seq_first [S]`` (first slot of each sequence) and ``seq_chunks [S]``.
    """
    n_seq = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk - 1) // chunk
    cend = jnp.cumsum(nch)
    cs = cend - nch
    slot = jnp.arange(n_slots, dtype=jnp.int32)
    seq = jnp.searchsorted(cend, slot, side="right")
    real = seq < n_seq
    seq = jnp.minimum(seq, n_seq - 1)
    within = slot - cs[seq]
    start = jnp.where(real, cu[seq] + within * chunk, 0)
    length = jnp.where(real, jnp.clip(lens[seq] - within * chunk, 0, chunk), 0)
    i32 = lambda x: x.astype(jnp.int32)
    return i32(start), i32(length), i32(cs), i32(nch)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Static facts of one call, shared by the three ``pallas_call`` builders."""

    chunk: int
    sub: int
    bk: int
    bvs: int
    bvo: int
    grp: int
    scale: float
    use_l2norm: bool
    dots: _Dots
    exact_v: bool
    blocks: ChunkBlocks
    interpret: bool


def _params(warps: int, stages: int = 1):
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def intra_call(cfg: _Launch, start, length, k, v, g, beta):
    """Kernel 1 over flattened ``k [T, Hk, K]``, ``v [T, Hv, V]``, ``g, beta [T, Hv]``:
    returns the tuple ``inter`` = ``(W [NC, Hv, C, K], Uv [NC, Hv, C, V], Gc, rk [NC, Hv, C])``
    (f32), with ``store_t`` ``(Tb [NC, Hv, C, C], Gc, rk)`` (``v`` then unread); ``Gc, rk``
    are always the last two."""
    n_slots, tp, c = start.shape[0], k.shape[0], cfg.chunk
    dk, hv, dv, grp = k.shape[2], v.shape[1], v.shape[2], cfg.grp
    store_t = cfg.blocks.store_t
    slots = pl.BlockSpec((n_slots,), lambda *_: (0,))
    row_spec = pl.BlockSpec((tp, None), lambda i, h: (0, h))
    ins = [("start", start, slots), ("len", length, slots)]
    ins += [("k", k, pl.BlockSpec((tp, None, dk), lambda i, h: (0, h // grp, 0)))]
    ins += [] if store_t else [("v", v, pl.BlockSpec((tp, None, dv), lambda i, h: (0, h, 0)))]
    ins += [("g", g, row_spec), ("beta", beta, row_spec)]
    mat = lambda d: (
        pl.BlockSpec((None, None, c, d), lambda i, h: (i, h, 0, 0)),
        jax.ShapeDtypeStruct((n_slots, hv, c, d), F32),
    )
    vec = (
        pl.BlockSpec((None, None, c), lambda i, h: (i, h, 0)),
        jax.ShapeDtypeStruct((n_slots, hv, c), F32),
    )
    outs = [("tb", *mat(c))] if store_t else [("w", *mat(dk)), ("uv", *mat(dv))]
    outs += [("gc", *vec), ("rk", *vec)]
    kernel = functools.partial(
        _intra_kernel,
        names=tuple(x[0] for x in ins + outs),
        chunk=c,
        sub=cfg.sub,
        use_l2norm=cfg.use_l2norm,
        dots=cfg.dots,
        exact_v=cfg.exact_v,
    )
    out = fit.pallas_call(
        kernel,
        knobs=cfg.blocks,
        grid=(n_slots, hv),
        in_specs=[x[2] for x in ins],
        out_specs=[x[1] for x in outs],
        out_shape=[x[2] for x in outs],
        compiler_params=_params(cfg.blocks.warps_intra),
        interpret=cfg.interpret,
        name="gdn_chunk_intra",
    )(*(x[1] for x in ins))
    return tuple(out)


def state_call(cfg: _Launch, seq_first, seq_chunks, start, length, q, k, v, inter, s0, out_dtype):
    """Kernel 2 on kernel 1's ``inter`` (and the flattened ``q, k, v``; ``q`` read only with
    ``fuse_out``, ``v`` only with ``store_t``): returns ``U [NC, Hv, C, V]`` (f32, bf16 with
    ``u_bf16``), the state entering every chunk ``h [NC, Hv, K, V]`` (f32, bf16 with ``h_bf16``)
    and the final states ``[S, Hv, K, V]`` (f32); with ``fuse_out`` ``(o [T, Hv, V] in
    out_dtype, final states)``."""
    n_seq, n_slots, tp, c = seq_first.shape[0], start.shape[0], k.shape[0], cfg.chunk
    dk, hv, dv, grp, bvs = k.shape[2], v.shape[1], v.shape[2], cfg.grp, cfg.bvs
    store_t, fuse = cfg.blocks.store_t, cfg.blocks.fuse_out
    seqs = pl.BlockSpec((n_seq,), lambda *_: (0,))
    slots = pl.BlockSpec((n_slots,), lambda *_: (0,))
    s_spec = pl.BlockSpec((None, None, dk, bvs), lambda s, h, j: (s, h, 0, j))
    u_spec = pl.BlockSpec((n_slots, None, c, bvs), lambda s, h, j: (0, h, 0, j))
    vec_spec = pl.BlockSpec((n_slots, None, c), lambda s, h, j: (0, h, 0))
    mat_spec = lambda d: pl.BlockSpec((n_slots, None, c, d), lambda s, h, j: (0, h, 0, 0))
    qk_spec = pl.BlockSpec((tp, None, dk), lambda s, h, j: (0, h // grp, 0))
    tok_spec = pl.BlockSpec((tp, None, bvs), lambda s, h, j: (0, h, j))
    ins = [("cs", seq_first, seqs), ("nch", seq_chunks, seqs)]
    ins += [("start", start, slots), ("len", length, slots), ("k", k, qk_spec)]
    if store_t:
        ins += [("v", v, tok_spec), ("tb", inter[0], mat_spec(c))]
    else:
        ins += [("w", inter[0], mat_spec(dk)), ("uv", inter[1], u_spec)]
    ins += [("gc", inter[-2], vec_spec), ("rk", inter[-1], vec_spec)]
    ins += [("q", q, qk_spec)] if fuse else []
    ins += [("s0", s0, s_spec)]
    if fuse:
        outs = [("o", tok_spec, jax.ShapeDtypeStruct((tp, hv, dv), out_dtype))]
    else:
        outs = [
            (
                "u",
                u_spec,
                jax.ShapeDtypeStruct((n_slots, hv, c, dv), BF16 if cfg.blocks.u_bf16 else F32),
            ),
            (
                "h",
                pl.BlockSpec((n_slots, None, dk, bvs), lambda s, h, j: (0, h, 0, j)),
                jax.ShapeDtypeStruct((n_slots, hv, dk, dv), BF16 if cfg.blocks.h_bf16 else F32),
            ),
        ]
    outs += [("sf", s_spec, jax.ShapeDtypeStruct((n_seq, hv, dk, dv), F32))]
    kernel = functools.partial(
        _state_kernel,
        names=tuple(x[0] for x in ins + outs),
        chunk=c,
        block_k=cfg.bk,
        dots=cfg.dots,
        scale=cfg.scale,
        use_l2norm=cfg.use_l2norm,
    )
    out = fit.pallas_call(
        kernel,
        knobs=cfg.blocks,
        grid=(n_seq, hv, dv // bvs),
        in_specs=[x[2] for x in ins],
        out_specs=[x[1] for x in outs],
        out_shape=[x[2] for x in outs],
        compiler_params=_params(cfg.blocks.warps_state, cfg.blocks.stages_state),
        interpret=cfg.interpret,
        name="gdn_chunk_state",
    )(*(x[1] for x in ins))
    return tuple(out)


def out_call(cfg: _Launch, start, length, q, k, gc, rk, u, hst, out_dtype):
    """Kernel 3: ``o [T, Hv, V]`` in ``out_dtype``."""
    n_slots, tp, c = start.shape[0], q.shape[0], cfg.chunk
    dk, hv, dv, grp, bvo = q.shape[2], u.shape[1], u.shape[3], cfg.grp, cfg.bvo
    slots = pl.BlockSpec((n_slots,), lambda *_: (0,))
    kernel = functools.partial(
        _out_kernel,
        chunk=c,
        block_k=cfg.bk,
        scale=cfg.scale,
        use_l2norm=cfg.use_l2norm,
        dots=cfg.dots,
    )
    return fit.pallas_call(
        kernel,
        knobs=cfg.blocks,
        grid=(n_slots, hv, dv // bvo),
        in_specs=[
            slots,
            slots,
            pl.BlockSpec((tp, None, dk), lambda i, h, j: (0, h // grp, 0)),
            pl.BlockSpec((tp, None, dk), lambda i, h, j: (0, h // grp, 0)),
            pl.BlockSpec((None, None, c), lambda i, h, j: (i, h, 0)),
            pl.BlockSpec((None, None, c), lambda i, h, j: (i, h, 0)),
            pl.BlockSpec((None, None, c, bvo), lambda i, h, j: (i, h, 0, j)),
            pl.BlockSpec((None, None, dk, bvo), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=pl.BlockSpec((tp, None, bvo), lambda i, h, j: (0, h, j)),
        out_shape=jax.ShapeDtypeStruct((tp, hv, dv), out_dtype),
        compiler_params=_params(cfg.blocks.warps_out),
        interpret=cfg.interpret,
        name="gdn_chunk_out",
    )(start, length, q, k, gc, rk, u, hst)


def prepare(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    *,
    scale,
    use_qk_l2norm,
    chunk_size,
    cu_seqlens,
    blocks,
    interpret,
):
    """Checks the inputs (ValueError naming the argument) and returns ``(cfg, plan, flat)``:
    the launch facts, the chunk plan ``(start, length, seq_first, seq_chunks)`` and the inputs
    flattened over tokens ``(q, k [T', Hk, K], v [T', Hv, V], g, beta [T', Hv], S0 f32)``
    (``T' = B T``, plus one chunk of padding in interpret mode)."""
    n_seq = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, blocks)
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    c = chunk_size
    tt = b * t
    if cu_seqlens is None:
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
        n_slots = b * (-(-t // c))
    else:
        cu = cu_seqlens.astype(jnp.int32)
        n_slots = tt // c + n_seq
    plan = chunk_plan(cu, c, max(n_slots, 1))
    if initial_state is None:
        initial_state = jnp.zeros((n_seq, hv, dk, dv), F32)
    flat = [x.reshape((tt,) + x.shape[2:]) for x in (q, k, v, g, beta)]
    if interpret:
        # Interpret mode clamps out-of-range slices instead of masking: give it room.
        flat = [jnp.pad(x, [(0, c)] + [(0, 0)] * (x.ndim - 1)) for x in flat]
    bf16 = jnp.dtype(BF16)
    exact = blocks.exact_bf16_inputs and q.dtype == k.dtype == bf16
    precision = blocks.precision
    if precision == "auto":
        precision = "bf16x3" if q.dtype == k.dtype == v.dtype == bf16 else "tf32x3"
    cfg = _Launch(
        chunk=c,
        sub=min(blocks.sub, c),
        bk=min(blocks.block_k, dk),
        bvs=min(blocks.block_v_state, dv),
        bvo=min(blocks.block_v_out, dv),
        grp=hv // hk,
        scale=dk**-0.5 if scale is None else float(scale),
        use_l2norm=use_qk_l2norm,
        dots=_Dots(precision, interpret, exact),
        exact_v=exact and v.dtype == bf16,
        blocks=blocks,
        interpret=interpret,
    )
    return cfg, plan, (*flat, initial_state.astype(F32))


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    output_final_state: bool = True,
    chunk_size: int = 64,
    cu_seqlens: jax.Array | None = None,
    blocks: ChunkBlocks = DEFAULT_CHUNK_BLOCKS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked gated delta rule in three kernels. ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``,
    ``g, beta [B, T, Hv]``; with ``cu_seqlens [S + 1]`` (``B == 1``) the ``T`` axis packs ``S``
    sequences. Same semantics as :func:`pallas_kernels.chunk_gated_delta_rule`.

    Returns ``(o [B, T, Hv, V] in v's dtype, final state f32 [B or S, Hv, K, V] or None)``.
    """
    q, k, v, g, beta, initial_state, cu_seqlens = (
        None if x is None else jnp.asarray(x) for x in (q, k, v, g, beta, initial_state, cu_seqlens)
    )
    b, t = k.shape[:2]
    hv, dv = v.shape[2], v.shape[3]
    cfg, (start, length, seq_first, seq_chunks), (q, k, v, g, beta, s0) = prepare(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        blocks=blocks,
        interpret=interpret,
    )
    inter = intra_call(cfg, start, length, k, v, g, beta)
    res = state_call(cfg, seq_first, seq_chunks, start, length, q, k, v, inter, s0, v.dtype)
    if blocks.fuse_out:
        o, final = res
    else:
        u, hst, final = res
        o = out_call(cfg, start, length, q, k, *inter[-2:], u, hst, v.dtype)
    o = o[: b * t].reshape(b, t, hv, dv)
    return o, (final if output_final_state else None)
