"""Routed experts of a decode step as one Mosaic GPU kernel (Hopper: TMA copies and ``wgmma``).

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) )  [+ h_s[m] W_s^T]

The same contract as :func:`pallas_kernels.moe.routed_experts_decode` (the Triton kernel), for
2-byte weights and up to 8 tokens. Program ``q`` of a 1-D grid of ``n T`` programs (``n = M k``
pairs, ``T = I / 64`` column tiles of ``I``) does pair ``p = q // T`` (token ``p // k``, expert
``e``) for the 64 columns ``t = q mod T`` of ``I`` with one warpgroup, streaming its ``3 H 64``
weights once from HBM by TMA through one ring of ``stages`` shared-memory slots that serves
both stages, so the down tiles arrive behind the gate/up tiles without the pipeline draining:

* a slot holds two ``[64, 64]`` tiles (16 KiB): in stage 1 the gate and up tiles of 64 rows of
  ``H`` (with the matching ``[8, 64]`` tile of ``x``, the tokens zero-padded to 8 rows), in
  stage 2 two down tiles ``[64 (I), 64 (H)]``. Load ``g`` goes to slot ``g mod stages``,
  issued once the products reading that slot's previous load are done;
* stage 1 swaps the operands so the weights fill the 64 rows of the tensor-core product:
  ``g^T [64, 8] += gate_tile^T x_tile^T`` (likewise ``u``; f32 accumulators). With
  ``defer_wait`` a step waits only for the previous step's products, so one step's stay in
  flight while the next slot is awaited;
* ``h = w silu(g) u`` in f32, the pair's token column kept, rounded to the weights' dtype (as
  the Triton kernel does) and stored transposed as the next product's ``[8, 64]`` operand;
* stage 2: ``y^T [64, 8] = down_tile^T h^T`` per pair of down tiles; the token's column is
  reduced out into an f32 row of ``H`` in shared memory, stored by one TMA as the pair's row of
  the kernel's output ``y [M, k T (+ 1), H]`` (a token's rows together).

``shared = (h_s [M, I_s], w_s [H, I_s])`` or a :class:`~pallas_kernels.moe.decode.SharedGLU`
(the shared expert's down projection) adds ``H / 64`` programs, each computing 64 rows of ``H``
of every token's term, ``w_s_tile [64, 64] h_s_tile^T`` over ``I_s``, into the token's last row
of ``y``. At one token the 64 routed and 32 shared programs of Qwen3.5-35B-A3B's MoE are one
wave on the H200's 132 SMs.

Around the kernel XLA runs two fusions: before it, the tokens' product operands (``x`` and
``h_s`` zero-padded to 8 rows in 64-column tiles; a ``SharedGLU``'s activation formed there in
f32 and rounded once); after it, each token's rows summed in a fixed order and cast (no atomics,
deterministic). Pairs with ids outside ``[0, E)`` issue no loads and store a zero row.

Off a compute capability 9.x GPU the kernel runs only in Mosaic GPU's interpret mode
(``interpret=True``), which simulates the TMA copies, barriers and products on the host but
runs each product synchronously, so it cannot show a slot refilled before its products
finished; the ring's order is what makes that safe (a slot is refilled only after
``wgmma_wait`` has retired the products reading it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._wy import F32
from pallas_kernels.moe import mgpu
from pallas_kernels.moe._common import check_moe_inputs, swiglu
from pallas_kernels.moe.decode import SharedGLU, check_shared, shared_weight

TILE = 64  # the product's A rows, and one 128-byte swizzle span of 2-byte elements
TOKENS = 8  # the product's N: tokens padded to 8 columns
SWIZZLE = 128


@dataclasses.dataclass(frozen=True)
class MgpuDecodeBlocks:
    """Static knobs of :func:`routed_experts_decode_mgpu`. ``stages``: slots of the
    shared-memory ring (16 KiB each; 12 ask for 220448 bytes a block on the H200, 13 for more
    than its 232448; 5 fit two blocks on an SM); ``defer_wait``: stage 1 keeps one step's
    products in flight (module docstring); ``max_pairs``: the most pairs ``M * k`` a call may
    have."""

    stages: int = 12
    defer_wait: bool = True
    max_pairs: int = 64

    def __post_init__(self):
        if not isinstance(self.stages, int) or not 1 <= self.stages <= 12:
            raise ValueError(f"stages: an int in [1, 12], got {self.stages!r}")
        if self.max_pairs < 1:
            raise ValueError(f"max_pairs: at least 1, got {self.max_pairs}")


DEFAULT_MGPU_DECODE_BLOCKS = MgpuDecodeBlocks()


def check_decode_mgpu(
    x, weights, experts, gate, up, down, shared, blocks: MgpuDecodeBlocks, interpret
):
    """``(M, k, E, H, I)``; ``ValueError`` naming the argument for inputs (or a machine) the
    kernel cannot take."""
    m, k, e, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    if jnp.dtype(gate.dtype).itemsize != 2:
        raise ValueError(
            f"gate: the Mosaic GPU decode kernel takes bfloat16 or float16 weights, got "
            f"{gate.dtype}"
        )
    if i % TILE or h % (2 * TILE):
        raise ValueError(
            f"gate: the Mosaic GPU decode kernel needs I a multiple of {TILE} and H of "
            f"{2 * TILE}, got I {i}, H {h}"
        )
    if m > TOKENS or m * k > blocks.max_pairs:
        raise ValueError(
            f"experts: the Mosaic GPU decode kernel takes at most {TOKENS} tokens and "
            f"{blocks.max_pairs} token-expert pairs (M * k), got {m} * {k}"
        )
    if shared is not None:
        check_shared(shared, m, h)
        w_s = shared_weight(shared)
        if w_s.dtype != gate.dtype or w_s.shape[1] % TILE:
            raise ValueError(
                f"shared: w_s must have gate's dtype {gate.dtype} and I_s a multiple of {TILE}, "
                f"got {w_s.dtype} [{w_s.shape[0]}, {w_s.shape[1]}]"
            )
    mgpu.check_hopper("the Mosaic GPU decode kernel", interpret)
    return m, k, e, h, i


def _transforms(dtype):
    return (
        plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(SWIZZLE),
    )


def _tiles(a: jax.Array, dtype) -> jax.Array:
    """``a [M, D]`` as ``[D / 64, 8, 64]`` in ``dtype``: the tokens zero-padded to 8 rows, one
    K-major product operand per 64 columns."""
    m, d = a.shape
    a = jnp.zeros((TOKENS, d), dtype).at[:m].set(a.astype(dtype))
    return a.reshape(TOKENS, d // TILE, TILE).transpose(1, 0, 2)


def _glu(shared: SharedGLU) -> jax.Array:
    """The shared expert's activation ``[M, I_s]`` in f32 (rounded once, to the weights' dtype,
    by the caller), as the Triton kernel forms it."""
    a, i_s = shared.act.astype(F32), shared.w_s.shape[1]
    g = a[:, shared.gate_col : shared.gate_col + i_s]
    u = a[:, shared.up_col : shared.up_col + i_s]
    z = a[:, shared.logit_col : shared.logit_col + 1]
    return swiglu(g, u) / (1.0 + jnp.exp(-z))


def _kernel(*refs, n, k, e, tiles, h, ns, defer_wait, shared_steps, dtype, m):
    """Program ``q``: pair ``q // tiles``'s expert over column tile ``q mod tiles`` of ``I``,
    or for ``q >= n tiles`` rows ``64 (q - n tiles) ..`` of ``H`` of the shared term."""
    b = TILE
    shared = shared_steps > 0
    if shared:
        ids_ref, w_ref, x_ref, g_ref, u_ref, d_ref, ws_ref, y_ref = refs
    else:
        ids_ref, w_ref, x_ref, g_ref, u_ref, d_ref, y_ref = refs
    per_token = k * tiles + int(shared)  # a token's rows of y: its pairs', its shared term's
    steps = h // b  # stage-1 loads: a gate, an up and an x tile
    loads = steps + h // (2 * b)  # then stage-2 loads: two down tiles
    q = lax.axis_index("q")
    routed = n * tiles
    tr = _transforms(dtype)
    acc_type = plgpu.ACC((b, TOKENS), F32)
    col = plgpu.broadcasted_iota(jnp.int32, (b, TOKENS), 1, layout=plgpu.Layout.WGMMA)
    ring = (
        plgpu.SMEM((ns, 2, b, b), dtype, transforms=tr),
        plgpu.SMEM((ns, TOKENS, b), dtype, transforms=tr),
        plgpu.Barrier(num_barriers=ns),
        plgpu.Barrier(num_barriers=ns),
        plgpu.Barrier(num_barriers=ns),
    )

    pair = jnp.minimum(q // tiles, n - 1)
    t = q - pair * tiles
    tok = pair // k
    ex = ids_ref[pair]
    ok = (ex >= 0) & (ex < e)
    cols = pl.ds(t * b, b)
    row = tok * per_token + (pair - tok * k) * tiles + t  # this program's row of y

    def routed_program(buf, x_s, bar_a, bar_b, bar_x, h_s, o_s):
        ec = jnp.clip(ex, 0, e - 1)
        wt = w_ref[pair].astype(F32)
        g_src, u_src, d_src = g_ref.at[ec], u_ref.at[ec], d_ref.at[ec]

        def load(g, slot):
            """Issue load ``g`` (traced or static) into ``slot``."""

            @pl.when(g < steps)
            def _():
                rows = pl.ds(g * b, b)
                plgpu.copy_gmem_to_smem(g_src.at[rows, cols], buf.at[slot, 0], bar_a.at[slot])
                plgpu.copy_gmem_to_smem(u_src.at[rows, cols], buf.at[slot, 1], bar_b.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[g], x_s.at[slot], bar_x.at[slot])

            @pl.when((g >= steps) & (g < loads))
            def _():
                c = g - steps
                for half, bar in ((0, bar_a), (1, bar_b)):
                    src = d_src.at[cols, pl.ds((2 * c + half) * b, b)]
                    plgpu.copy_gmem_to_smem(src, buf.at[slot, half], bar.at[slot])

        for s in range(ns):
            load(jnp.int32(s), s)

        def gate_up(acc_g, acc_u):
            def step(g, carry):
                slot = lax.rem(g, ns)
                plgpu.barrier_wait(bar_a.at[slot])
                plgpu.barrier_wait(bar_b.at[slot])
                plgpu.barrier_wait(bar_x.at[slot])
                xs = x_s.at[slot].T  # [64, 8]: the K-major operand
                plgpu.wgmma(acc_g, buf.at[slot, 0].T, xs)
                plgpu.wgmma(acc_u, buf.at[slot, 1].T, xs)
                if defer_wait:  # this step's two products stay in flight
                    plgpu.wgmma_wait(2)

                    @pl.when(g > 0)
                    def _():
                        load(g - 1 + ns, lax.rem(g - 1, ns))

                else:
                    plgpu.wgmma_wait(0)
                    load(g + ns, slot)
                return carry

            lax.fori_loop(0, steps, step, 0)
            if defer_wait:
                plgpu.wgmma_wait(0)
                load(jnp.int32(steps - 1 + ns), (steps - 1) % ns)
            return acc_g[...], acc_u[...]

        gv, uv = pl.run_scoped(gate_up, acc_type, acc_type)
        act = swiglu(gv, uv) * wt  # [64, 8]
        h_s.T[...] = jnp.where(col == tok, act, 0.0).astype(dtype)  # h_s [8, 64]
        plgpu.commit_smem()

        def down(g, carry):
            slot = lax.rem(g, ns)
            c = g - steps
            plgpu.barrier_wait(bar_a.at[slot])
            plgpu.barrier_wait(bar_b.at[slot])

            def products(acc0, acc1):  # fresh accumulators per pair of tiles
                plgpu.wgmma(acc0, buf.at[slot, 0].T, h_s.T)
                plgpu.wgmma(acc1, buf.at[slot, 1].T, h_s.T)
                return acc0[...], acc1[...]  # retires both products

            y0, y1 = pl.run_scoped(products, acc_type, acc_type)
            load(g + ns, slot)
            for half, yv in ((0, y0), (1, y1)):
                o_s[pl.ds((2 * c + half) * b, b)] = jnp.sum(jnp.where(col == tok, yv, 0.0), axis=1)
            return carry

        lax.fori_loop(steps, loads, down, 0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, y_ref.at[row])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((q < routed) & ok)
    def _():
        pl.run_scoped(
            routed_program,
            *ring,
            plgpu.SMEM((TOKENS, b), dtype, transforms=tr),
            plgpu.SMEM((h,), F32),
        )

    def zero_row(o_s):
        o_s[...] = jnp.zeros((h,), F32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, y_ref.at[row])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((q < routed) & ~ok)  # an id outside [0, E): a zero row, no loads
    def _():
        pl.run_scoped(zero_row, plgpu.SMEM((h,), F32))

    if not shared:
        return

    def shared_program(buf, hs_s, bar_a, _bar_b, bar_x, o_s):
        j = q - routed
        rows = pl.ds(j * b, b)
        ms = min(ns, shared_steps)

        def load(s, slot):
            @pl.when(s < shared_steps)
            def _():
                src = ws_ref.at[rows, pl.ds(s * b, b)]
                plgpu.copy_gmem_to_smem(src, buf.at[slot, 0], bar_a.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[steps + s], hs_s.at[slot], bar_x.at[slot])

        for s in range(ms):
            load(jnp.int32(s), s)

        def products(acc):
            def step(s, carry):
                slot = lax.rem(s, ms)
                plgpu.barrier_wait(bar_a.at[slot])
                plgpu.barrier_wait(bar_x.at[slot])
                plgpu.wgmma(acc, buf.at[slot, 0], hs_s.at[slot].T)  # w_s rows are K-major
                plgpu.wgmma_wait(0)
                load(s + ms, slot)
                return carry

            lax.fori_loop(0, shared_steps, step, 0)
            return acc[...]

        ys = pl.run_scoped(products, acc_type)  # [64 rows of H, 8 tokens]
        for c in range(m):  # token c's term: 64 columns of its last row of y
            o_s[c, :] = jnp.sum(jnp.where(col == c, ys, 0.0), axis=1)
        plgpu.commit_smem()
        for c in range(m):
            plgpu.copy_smem_to_gmem(o_s.at[c], y_ref.at[(c + 1) * per_token - 1, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(q >= routed)
    def _():
        pl.run_scoped(shared_program, *ring, plgpu.SMEM((TOKENS, b), F32))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def routed_experts_decode_mgpu(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    shared: tuple[jax.Array, jax.Array] | SharedGLU | None = None,
    *,
    blocks: MgpuDecodeBlocks = DEFAULT_MGPU_DECODE_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the expert weights' dtype (module docstring): the arguments of
    :func:`pallas_kernels.moe.routed_experts_decode`, bf16 or f16 weights, ``M <= 8``, ``I`` a
    multiple of 64 and ``H`` of 128. Raises ``ValueError`` before launching for inputs the
    kernel cannot take, and off a Hopper GPU unless ``interpret``."""
    m, k, e, h, i = check_decode_mgpu(
        x, weights, experts, gate, up, down, shared, blocks, interpret
    )
    dtype, n, tiles = gate.dtype, m * k, i // TILE
    ns = min(blocks.stages, h // TILE + h // (2 * TILE))
    ids = experts.reshape(-1).astype(jnp.int32)
    # the product operands of the tokens (x, then the shared expert's h_s): one XLA fusion
    tokens, extra, shared_steps = [x], [], 0
    if shared is not None:
        w_s = shared_weight(shared)
        tokens.append(_glu(shared) if isinstance(shared, SharedGLU) else shared[0])
        extra, shared_steps = [w_s], w_s.shape[1] // TILE
    operands = jnp.concatenate([_tiles(a, dtype) for a in tokens])
    args = [ids, weights.reshape(-1), operands, gate, up, down, *extra]
    per_token = k * tiles + int(shared is not None)
    kernel = functools.partial(
        _kernel,
        n=n,
        k=k,
        e=e,
        tiles=tiles,
        h=h,
        ns=ns,
        defer_wait=blocks.defer_wait and ns >= 2,  # a deferred refill needs a second slot
        shared_steps=shared_steps,
        dtype=dtype,
        m=m,
    )
    y = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m * per_token, h), F32),
        grid=(n * tiles + (h // TILE if shared is not None else 0),),
        grid_names=("q",),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )(*args)
    return y.reshape(m, per_token, h).sum(axis=1).astype(dtype)
