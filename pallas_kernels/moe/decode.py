"""Routed experts of a decode step in one kernel: gate, up, SiLU, routing weight and down.

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) )  [+ h_s[m] W_s^T]

For one or a few tokens the two kernels of :mod:`pallas_kernels.moe.small_m` plus the XLA
fusions between and after them (partial sums, the SiLU product, the combine) are five to six
launches of a few microseconds each per layer, and the shared expert's down projection is
another. Here program ``(p, j)`` of a grid ``(n [+ M], T)`` owns pair ``p`` (token ``p // k``,
expert ``e = experts[p]``) and the ``block_i`` columns ``j`` of ``I``, and does the whole
expert for them:

1. ``g = x[tok] gate_e[:, cols]``, ``u = x[tok] up_e[:, cols]`` (the loop over ``H`` reads
   ``gate_e`` and ``up_e``'s column tile once, as dots of 16 rows, the token's and zeros, whose
   loop the compiler pipelines; f32 accumulation);
2. ``h = w[p] * silu(g) * u``, rounded to the weights' dtype (as the two-kernel path stores it);
3. ``y = h down_e[cols, :]`` over all of ``H`` (the tile's ``block_i`` rows of ``down_e``), stored
   as an f32 partial row of the token (row ``(p mod k) T + j`` of its ``k T`` rows).

So each pair's expert is read once (``3 H I`` weights over its ``T`` programs) and each token's
partial rows are summed after the kernel by one reduction, in a fixed order (no atomics,
deterministic). A token that names an expert twice, or two tokens that share one, read it
once per pair: meant for ``M * k`` up to a few dozen pairs. A pair whose id lies outside
``[0, E)`` stores a zero row.

``shared = (h_s [M, I_s], w_s [H, I_s])`` adds a dense term ``h_s w_s^T`` per token (the shared
expert's down projection, ``w_s`` in the ``[out, in]`` layout of a linear layer, ``h_s`` its
gated activation): ``M`` more programs along the grid's first axis, program ``(n + m, j)``
computing rows ``j * block_hs ..`` of token ``m``'s term (contiguous rows of ``w_s``) into the
token's last partial row (``k T + 1`` rows a token). ``shared =`` :class:`SharedGLU` gives the
activation as its pre-activations instead, columns of a wider array such as a fused input
projection's output: each of those programs forms ``sigmoid(logit) * silu(gate) * up`` from
them itself (f32, rounded once to ``w_s``'s dtype), so no kernel runs between the projection
and this one.

At Qwen3.5-35B-A3B's MoE (E 256, k 8, H 2048, I 512, bf16) one decode token reads 8 experts
of 6.3 MB and the shared expert's 2 MB down projection: 52 MB, 12.4 us at 4.2 TB/s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _fit as fit
from pallas_kernels._wy import F32
from pallas_kernels.moe._common import (
    check_knobs,
    check_moe_inputs,
    fit_block,
    mm,
    swiglu,
    weight_precision,
)

# rows of every dot: the token's row and zeros (a Triton dot takes at least 16 rows; a dot's
# loop is the one the compiler pipelines, its weight tiles loaded stages ahead)
DOT_ROWS = 16


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Static knobs of the decode kernel. ``block_i``: columns of ``I`` per program (so ``I /
    block_i`` programs per pair, each reading ``block_i``-wide column tiles of gate and up and
    ``block_i`` rows of down); ``block_k``: rows of ``H`` per step of the gate/up loop;
    ``block_h``: columns of ``H`` per step of the down loop; ``block_hs``: rows of the shared
    term's ``w_s`` per program; ``max_pairs``: the most pairs ``M * k`` a call may have;
    ``num_warps``, ``num_stages``: Triton launch knobs; ``precision``: the dot precision for
    float32 weights (bf16 / f16 weights: one exact-product pass, f32 accumulation). Block sizes
    are powers of two >= 16; a kernel uses the largest power of two <= the knob that divides
    the dimension. The defaults did best in a sweep on the H200 at Qwen3.5-35B-A3B's MoE, one
    token (``benchmarks/README.md#moe``). The GPU build's shared memory per block grows with
    ``num_stages`` times the tiles (bf16: 106496 bytes with the defaults and a shared term,
    204800 with ``block_hs=128``; float32 with a :class:`SharedGLU` term: 233472, over the
    H200's 232448, so float32 takes ``block_k=128`` there: 200704)."""

    block_i: int = 32
    block_k: int = 256
    block_h: int = 512
    block_hs: int = 64
    max_pairs: int = 64
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "tf32x3"

    def __post_init__(self):
        check_knobs(self, ("block_i", "block_k", "block_h", "block_hs"))
        if self.max_pairs < 1:
            raise ValueError(f"max_pairs: at least 1, got {self.max_pairs}")


DEFAULT_DECODE_BLOCKS = DecodeBlocks()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedGLU:
    """A shared expert's down-projection input given by its pre-activations, read in place:

        h_s = sigmoid(act[:, logit_col]) * silu(act[:, gate_col : gate_col + I_s])
              * act[:, up_col : up_col + I_s]

    with ``act [M, C]`` (e.g. a fused projection's output: the router's logits, the shared
    expert's gate and up projections and its gate logit side by side), ``w_s [H, I_s]`` its
    down projection (a linear layer's ``[out, in]`` layout). The column offsets are static. The
    ``shared`` argument of :func:`routed_experts_decode` and :func:`gdn_jax.routed_experts`."""

    act: jax.Array
    w_s: jax.Array
    gate_col: int = dataclasses.field(metadata=dict(static=True))
    up_col: int = dataclasses.field(metadata=dict(static=True))
    logit_col: int = dataclasses.field(metadata=dict(static=True))

    def activation(self) -> jax.Array:
        """``h_s [M, I_s]`` in ``act``'s dtype, computed by XLA (the paths without the decode
        kernel)."""
        a, i = self.act, self.w_s.shape[1]
        g, u = a[:, self.gate_col : self.gate_col + i], a[:, self.up_col : self.up_col + i]
        return jax.nn.sigmoid(a[:, self.logit_col : self.logit_col + 1]) * jax.nn.silu(g) * u


def _kernel(
    ids_ref,
    w_ref,
    x_ref,
    g_ref,
    u_ref,
    d_ref,
    *refs,
    n,
    k,
    e,
    tiles,
    bi,
    bk,
    bh,
    bhs,
    bks,
    precision,
    glu=None,
):
    """Program ``(p, j)``: pair ``p``'s expert over column tile ``j`` of ``I``, or for ``p >= n``
    rows ``j`` of token ``p - n``'s shared term (module docstring); ``glu``: the
    :class:`SharedGLU` column offsets ``(gate, up, logit)`` of the shared input, else it is
    ``h_s`` itself."""
    shared = len(refs) == 3
    per_token = k * tiles + int(shared)  # a token's partial rows: its pairs', its shared term's
    first = jax.lax.broadcasted_iota(jnp.int32, (DOT_ROWS, 1), 0) == 0
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, DOT_ROWS), 1) == 0
    hs_ref, ws_ref, y_ref = refs if shared else (None, None, *refs)
    p, j = pl.program_id(0), pl.program_id(1)
    h_dim = x_ref.shape[1]

    @pl.when((p < n) & (j < tiles))
    def _routed():
        pc = jnp.minimum(p, n - 1)
        ex = ids_ref[pc]
        ok = (ex >= 0) & (ex < e)
        ec = jnp.clip(ex, 0, e - 1)
        tok = pc // k
        cols = pl.ds(j * bi, bi)
        row = tok * per_token + (pc - tok * k) * tiles + j

        @pl.when(ok)
        def _():
            def step(s, acc):
                ag, au = acc
                xs = x_ref[tok, pl.ds(s * bk, bk)].astype(g_ref.dtype)
                xs = jnp.where(first, xs[None, :], 0).astype(g_ref.dtype)  # [DOT_ROWS, bk]
                ag = ag + mm(xs, g_ref[ec, pl.ds(s * bk, bk), cols], precision)
                au = au + mm(xs, u_ref[ec, pl.ds(s * bk, bk), cols], precision)
                return ag, au

            zero = jnp.zeros((DOT_ROWS, bi), F32)
            ag, au = jax.lax.fori_loop(0, h_dim // bk, step, (zero, zero))
            wt = w_ref[pc].astype(F32)
            h = swiglu(jnp.sum(ag, axis=0), jnp.sum(au, axis=0)) * wt  # [bi]
            h = jnp.where(first, h[None, :], 0).astype(d_ref.dtype)  # [DOT_ROWS, bi]

            def down(c, carry):
                y = mm(h, d_ref[ec, cols, pl.ds(c * bh, bh)], precision)  # [DOT_ROWS, bh]
                y_ref[row, pl.ds(c * bh, bh)] = jnp.sum(y, axis=0)
                return carry

            jax.lax.fori_loop(0, h_dim // bh, down, 0)

        @pl.when(~ok)
        def _():
            def zero_row(c, carry):
                y_ref[row, pl.ds(c * bh, bh)] = jnp.zeros((bh,), F32)
                return carry

            jax.lax.fori_loop(0, h_dim // bh, zero_row, 0)

    if shared:

        @pl.when((p >= n) & (j < h_dim // bhs))
        def _shared():
            m = jnp.maximum(p - n, 0)
            rows = pl.ds(j * bhs, bhs)
            i_s = ws_ref.shape[1]
            if glu is not None:
                gc, uc, lc = glu
                z = hs_ref[m, lc].astype(F32)
                sig = 1.0 / (1.0 + jnp.exp(-z))

            def step(s, acc):
                if glu is None:
                    hv = hs_ref[m, pl.ds(s * bks, bks)].astype(ws_ref.dtype)
                else:
                    g = hs_ref[m, pl.ds(gc + s * bks, bks)].astype(F32)
                    u = hs_ref[m, pl.ds(uc + s * bks, bks)].astype(F32)
                    hv = (sig * swiglu(g, u)).astype(ws_ref.dtype)
                hv = jnp.where(first_col, hv[:, None], 0).astype(ws_ref.dtype)  # [bks, DOT_ROWS]
                return acc + mm(ws_ref[rows, pl.ds(s * bks, bks)], hv, precision)

            acc = jax.lax.fori_loop(0, i_s // bks, step, jnp.zeros((bhs, DOT_ROWS), F32))
            y_ref[m * per_token + k * tiles, rows] = jnp.sum(acc, axis=1)


def check_decode(x, weights, experts, gate, up, down, shared, blocks: DecodeBlocks):
    """``(M, k, E, H, I)``; ``ValueError`` naming the argument for inputs the kernel cannot
    take (:func:`pallas_kernels.moe._common.check_moe_inputs`, more than ``blocks.max_pairs``
    pairs, a ``shared`` term of the wrong shape)."""
    m, k, e, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    if m * k > blocks.max_pairs:
        raise ValueError(
            f"experts: the decode MoE kernel takes at most {blocks.max_pairs} token-expert "
            f"pairs (M * k), got {m} * {k} = {m * k}; use the small-M kernels"
        )
    if shared is not None:
        check_shared(shared, m, h)
        fit_block("I_s", shared_weight(shared).shape[1], 16)
    return m, k, e, h, i


def shared_weight(shared) -> jax.Array:
    """``w_s`` of a ``shared`` argument (a pair or a :class:`SharedGLU`)."""
    return shared.w_s if isinstance(shared, SharedGLU) else shared[1]


def check_shared(shared, m: int, h: int) -> None:
    """``ValueError`` unless ``shared`` is ``(h_s [M, I_s], w_s [H, I_s])`` of float arrays or
    a :class:`SharedGLU` whose ``act [M, C]`` holds its columns."""
    if isinstance(shared, SharedGLU):
        act, ws = shared.act, shared.w_s
        if getattr(act, "ndim", None) != 2 or act.shape[0] != m:
            raise ValueError(
                f"shared: act must be [M={m}, C], got shape {getattr(act, 'shape', None)}"
            )
        if getattr(ws, "ndim", None) != 2 or ws.shape[0] != h:
            raise ValueError(
                f"shared: w_s must be [H={h}, I_s] (a linear layer's [out, in]), got shape "
                f"{getattr(ws, 'shape', None)}"
            )
        i_s, c = ws.shape[1], act.shape[1]
        for name, col, width in (
            ("gate_col", shared.gate_col, i_s),
            ("up_col", shared.up_col, i_s),
            ("logit_col", shared.logit_col, 1),
        ):
            if not isinstance(col, int) or col < 0 or col + width > c:
                raise ValueError(
                    f"shared: {name} {col} + {width} columns do not fit act's {c} columns"
                )
        for name, a in (("act", act), ("w_s", ws)):
            if not jnp.issubdtype(a.dtype, jnp.floating):
                raise ValueError(f"shared: {name} must be floating point, got {a.dtype}")
        return
    if not isinstance(shared, tuple | list) or len(shared) != 2:
        raise ValueError("shared: expected a pair (h_s [M, I_s], w_s [H, I_s]) or a SharedGLU")
    hs, ws = shared
    if getattr(hs, "ndim", None) != 2 or hs.shape[0] != m:
        raise ValueError(
            f"shared: h_s must be [M={m}, I_s], got shape {getattr(hs, 'shape', None)}"
        )
    if getattr(ws, "ndim", None) != 2 or ws.shape != (h, hs.shape[1]):
        raise ValueError(
            f"shared: w_s must be [H={h}, I_s={hs.shape[1]}] (a linear layer's [out, in]), got "
            f"shape {getattr(ws, 'shape', None)}"
        )
    for name, a in (("h_s", hs), ("w_s", ws)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"shared: {name} must be floating point, got {a.dtype}")


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def routed_experts_decode(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    shared: tuple[jax.Array, jax.Array] | SharedGLU | None = None,
    *,
    blocks: DecodeBlocks = DEFAULT_DECODE_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the expert weights' dtype (module docstring): ``x [M, H]``,
    ``weights [M, k]``, ``experts int [M, k]`` (ids outside ``[0, E)`` add nothing),
    ``gate, up [E, H, I]``, ``down [E, I, H]``, optional ``shared = (h_s [M, I_s], w_s [H,
    I_s])`` or a :class:`SharedGLU`. Raises ``ValueError`` before launching for inputs the kernel cannot take."""
    m, k, e, h, i = check_decode(x, weights, experts, gate, up, down, shared, blocks)
    n = m * k
    bi = fit_block("I", i, blocks.block_i)
    bk = fit_block("H", h, blocks.block_k)
    bh = fit_block("H", h, blocks.block_h)
    tiles = i // bi
    extra, cols = (), tiles
    rows = n * tiles
    bhs = bks = 16
    glu = None
    if shared is not None:
        w_s = shared_weight(shared)
        bhs = fit_block("H", h, blocks.block_hs)
        bks = fit_block("I_s", w_s.shape[1], blocks.block_k)
        if isinstance(shared, SharedGLU):
            extra, glu = (shared.act, w_s), (shared.gate_col, shared.up_col, shared.logit_col)
        else:
            extra = tuple(shared)
        cols = max(tiles, h // bhs)
        rows += m
    kernel = functools.partial(
        _kernel,
        n=n,
        k=k,
        e=e,
        tiles=tiles,
        bi=bi,
        bk=bk,
        bh=bh,
        bhs=bhs,
        bks=bks,
        precision=weight_precision(gate.dtype, blocks.precision, interpret),
        glu=glu,
    )
    whole = pl.BlockSpec(memory_space=None)
    y = fit.pallas_call(
        kernel,
        knobs=blocks,
        grid=(n + (m if extra else 0), cols),
        in_specs=[whole] * (6 + len(extra)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((rows, h), F32),
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="moe_decode",
    )(experts.reshape(-1).astype(jnp.int32), weights.reshape(-1), x, gate, up, down, *extra)
    return y.reshape(m, rows // m, h).sum(axis=1).astype(gate.dtype)
