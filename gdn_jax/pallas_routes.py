"""Adapts ``pallas_kernels`` to the ``gdn_jax`` op signatures and registers them in
:data:`gdn_jax.dispatch.PALLAS_OPS` on import.

The kernels apply the q/k l2norm and scale themselves (the same formula as
:func:`gdn_jax._prep.prepare_qk`), so raw q/k go straight in without an extra pass over HBM. On a
CPU backend the kernels run in interpret mode, so ``impl="pallas"`` works (slowly) everywhere.

Registered: ``tree_verify`` (:func:`pallas_kernels.tree_verify`, the "refine" kernel: one-pass
dots, an approximate inverse and iterative refinement of ``U``; its 3-pass dots run as bf16x3
for bf16 inputs on a GPU, tf32x3 otherwise, and bf16x3 where a tf32x3 build would exceed the
GPU's shared memory: f32 q/k above 64 nodes at K 128), ``tree_commit`` and
``chunk_gated_delta_rule`` (the three-kernel prefill). ``"auto"`` takes them on a GPU where they
were measured faster than the XLA path (benchmarks/README.md, ``python -m benchmarks.kernels``):
verify for trees of at most :data:`AUTO_MAX_NODES` nodes with power-of-two head dims whose
tf32x3 / bf16x3 build fits the shared memory (at 128 nodes the kernel runs but is no faster
than XLA); commit for the same node count and head dims and only from
:data:`AUTO_COMMIT_MIN_ROWS` rows of ``B * Hv``; the chunked prefill for power-of-two head dims
and chunks of 16 to 64 tokens. Also registered: the MoE kernels (``routed_experts``,
``route_topk``, ``balanced_route``) and the snapshot baseline's verify
(``snapshot_tree_verify``, :func:`pallas_kernels.snapshot_verify`, for power-of-two head dims:
one fused kernel per layer where the XLA path loops over the nodes with several kernels each).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from gdn_jax.dispatch import AUTO_PALLAS, PALLAS_OPS
from gdn_jax.tree_wy import TreeCache
from pallas_kernels import moe as moe_kernels
from pallas_kernels.verify.kernel import check_gpu_limits

AUTO_MAX_NODES = 64
# store_t: the intra kernel stores T diag(beta) instead of W and U (1.26x / 1.22x faster on the
# H200 at B 8, T 4096 / B 1, T 16384; benchmarks/README.md).
CHUNK_BLOCKS = pallas_kernels.ChunkBlocks(store_t=True)


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _pow2_dim(x: int) -> bool:
    """A head dim the GPU kernels take: a power of two in [16, 256]."""
    return 16 <= x <= 256 and x & (x - 1) == 0


def _fits_gpu_kernel(q, k, v) -> bool:
    n, dk, dv = k.shape[1], k.shape[3], v.shape[3]
    return n <= AUTO_MAX_NODES and _pow2_dim(dk) and _pow2_dim(dv)


def _verify_launches(blocks, q, k, v) -> bool:
    """Whether the verify kernel's GPU build with ``blocks`` passes its pre-launch limits."""
    try:
        check_gpu_limits(blocks, k.shape[1], k.shape[3], v.shape[3], q.dtype, k.dtype)
    except ValueError:
        return False
    return True


def _measured_verify_blocks(q, k, v, interpret: bool) -> pallas_kernels.VerifyBlocks:
    low = q.dtype == k.dtype == v.dtype == jnp.bfloat16
    return pallas_kernels.VerifyBlocks(precision="bf16x3" if low and not interpret else "tf32x3")


def verify_blocks_for(q, k, v, interpret: bool) -> pallas_kernels.VerifyBlocks:
    """The verify kernel's knobs for these inputs: its 3-pass dots as bf16x3 when q, k and v are
    all bf16 on a GPU, else tf32x3 (default mode "refine": one-pass dots, bf16 approximate
    inverse, two refinement steps). On a GPU, where the tf32x3 build would exceed the shared
    memory per block (f32 q/k at more than 64 nodes with K 128: 256 KiB against 227 KiB), the
    3-pass dots run as bf16x3 if that fits (128 KiB there; O's relative error ~6e-6 against
    ~4e-7 for tf32x3, the H200's dots emulated on the CPU); where nothing fits the kernel raises
    its ValueError. Shared with the serving arena's verify."""
    blocks = _measured_verify_blocks(q, k, v, interpret)
    if interpret or blocks.precision == "bf16x3" or _verify_launches(blocks, q, k, v):
        return blocks
    fallback = dataclasses.replace(blocks, precision="bf16x3")
    return fallback if _verify_launches(fallback, q, k, v) else blocks


def _verify_auto(q, k, v) -> bool:
    """``"auto"``: trees of at most :data:`AUTO_MAX_NODES` nodes, power-of-two head dims and a
    GPU build of the measured knobs that fits the shared memory (f32 q/k with K 256 at 64 nodes
    does not)."""
    blocks = _measured_verify_blocks(q, k, v, interpret=False)
    return _fits_gpu_kernel(q, k, v) and _verify_launches(blocks, q, k, v)


def tree_verify(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """``(o, u, g_path)`` of the tree WY verify (see :func:`gdn_jax.tree_verify`)."""
    interpret = _interpret()
    blocks = verify_blocks_for(q, k, v, interpret)
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
    return cache.commit_with(
        pallas_kernels.tree_commit, initial_state, path, path_len, interpret=_interpret()
    )


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **options):
    """``(o, final state)`` of the chunked prefill (see :func:`gdn_jax.chunk_gated_delta_rule`;
    ``options``: ``scale``, ``use_qk_l2norm``, ``output_final_state``, ``chunk_size``,
    ``cu_seqlens``)."""
    return pallas_kernels.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state, blocks=CHUNK_BLOCKS, interpret=_interpret(), **options
    )


def _fits_chunk_kernel(q, k, v, chunk_size) -> bool:
    dims = _pow2_dim(k.shape[3]) and _pow2_dim(v.shape[3])
    return dims and chunk_size in (16, 32, 64)


PALLAS_OPS.update(
    tree_verify=tree_verify, tree_commit=tree_commit, chunk_gated_delta_rule=chunk_gated_delta_rule
)
# The commit kernel is slower than XLA at N = 128 and at small B x Hv (H200: 12.5 against 5.9 us
# at B 1, Hv 64; level at B 16, Hv 32; 67.8 against 92.8 us at B 64, Hv 32).
AUTO_COMMIT_MIN_ROWS = 1024  # B * Hv


def _commit_auto(cache) -> bool:
    b, hv = cache.u.shape[0], cache.u.shape[2]
    return _fits_gpu_kernel(cache.k, cache.k, cache.u) and b * hv >= AUTO_COMMIT_MIN_ROWS


# "auto" takes the kernels where they were measured faster than XLA on the H200
# (benchmarks/README.md).
AUTO_PALLAS.update(
    chunk_gated_delta_rule=_fits_chunk_kernel,
    tree_verify=_verify_auto,
    tree_commit=_commit_auto,
)


# ------------------------------------------------------------------ routed experts (MoE FFN)
# pallas_kernels.moe: the small-M kernels (each touched expert's weights read once; no routing
# plan in XLA) up to MOE_SMALL_M.max_pairs token-expert pairs, the Triton grouped GEMM beyond.
# Its tiles for 2-byte weights (kernel time over the floor on the H200 at Qwen3.5-35B-A3B's
# MoE, `python -m benchmarks.moe --profile`): up to MOE_FEW_PAIRS pairs (tree verify: an expert
# gets a few dozen rows) 32-row expert blocks with wide tiles (1.14x at M 464, 1.49x with the
# default tiles), beyond them 128-row blocks, eight warps (1.87x at M 8192, 2.33x); float32
# weights take the defaults (the wide tiles' stages need more shared memory than a block has).
MOE_SMALL_M = moe_kernels.SmallMBlocks()
MOE_GROUPED_FEW = moe_kernels.GroupedBlocks(
    block_m=32, block_i=128, block_h=256, block_kh=64, block_ki=64, num_stages=4
)
MOE_GROUPED_MANY = moe_kernels.GroupedBlocks(
    block_m=128, block_i=128, block_h=256, block_kh=64, block_ki=64, num_warps=8, num_stages=4
)
MOE_GROUPED = moe_kernels.GroupedBlocks()
MOE_FEW_PAIRS = 8192


# Tokens up to which the routed experts run as the one decode kernel (pallas_kernels.moe.decode,
# with the shared expert's down projection in the same launch): at M 1 on the H200 19.6 us of
# kernel time against the small-M kernels' 22.4 (1.60x and 1.84x the floor), two launches a
# layer fewer; M >= 2 stays on small_m (1.19x at M 4; the decode kernel was not measured there
# with its dots) (`python -m benchmarks.moe --paths decode,small_m --profile`). For 2-byte
# weights the shared term in 128-row blocks (at M 1 with the shared expert: 22.8 us of kernel
# time against 23.8 with the 64-row default; 256 rows ask for more shared memory than a block
# has; benchmarks/README.md, moe). Float32 weights take 128 rows of H a gate/up step: with the
# shared expert's activation formed in the kernel (SharedGLU), the defaults' build asks for
# 233472 bytes of shared memory per block, over the H200's 232448, and fails to launch; 128
# rows ask for 200704 with or without the term; 2-byte weights with 128-row shared blocks ask
# for 204800 (deviceless H200 builds: `benchmarks.compile_report --kernel moe_decode`; every
# route's build fits: `--kernel moe_routes`; benchmarks/README.md, compile_report).
MOE_DECODE = moe_kernels.DecodeBlocks(block_hs=128)
MOE_DECODE_F32 = moe_kernels.DecodeBlocks(block_k=128)
MOE_DECODE_MAX_TOKENS = 1
# The decode route's Mosaic GPU kernel (pallas_kernels/moe/decode_mgpu.py: TMA ring, wgmma) in
# place of the Triton one where it takes the call (2-byte weights); off until timed on the
# H200 (benchmarks.model_step --moe-decode-mgpu, benchmarks.moe's decode_mgpu path).
MOE_DECODE_MGPU = False
MOE_DECODE_MGPU_BLOCKS = moe_kernels.DEFAULT_MGPU_DECODE_BLOCKS


def _moe_decode_blocks(dtype) -> moe_kernels.DecodeBlocks:
    return MOE_DECODE if jnp.dtype(dtype).itemsize <= 2 else MOE_DECODE_F32


def routed_experts(x, weights, experts, gate_proj, up_proj, down_proj, *, shared=None):
    """``out [M, H]`` of the routed experts (see :func:`gdn_jax.routed_experts`): the decode
    kernel up to ``MOE_DECODE_MAX_TOKENS`` tokens (its Mosaic GPU version with
    ``MOE_DECODE_MGPU``), the small-M kernels when ``M * k <=
    MOE_SMALL_M.max_pairs``, else the grouped kernels; ``shared``'s term in the decode kernel,
    else one matmul after the others."""
    from gdn_jax.moe import shared_pair, shared_term

    args = (x, weights, experts, gate_proj, up_proj, down_proj)
    if _moe_decode_mgpu(args, shared):
        return moe_kernels.routed_experts_decode_mgpu(
            *args, shared, blocks=MOE_DECODE_MGPU_BLOCKS, interpret=_interpret()
        )
    if _moe_decode(x, weights, experts, gate_proj, up_proj, down_proj, shared):
        return moe_kernels.routed_experts_decode(
            *args, shared, blocks=_moe_decode_blocks(gate_proj.dtype), interpret=_interpret()
        )
    if _moe_small(experts):
        out = moe_kernels.routed_experts_small_m(*args, blocks=MOE_SMALL_M, interpret=_interpret())
    else:
        blocks = _moe_grouped_blocks(experts, gate_proj.dtype)
        out = moe_kernels.routed_experts_grouped(*args, blocks=blocks, interpret=_interpret())
    return out if shared is None else out + shared_term(*shared_pair(shared), out.dtype)


def _moe_decode(x, weights, experts, gate_proj, up_proj, down_proj, shared) -> bool:
    if x.shape[0] > MOE_DECODE_MAX_TOKENS:
        return False
    try:
        moe_kernels.check_decode(
            x, weights, experts, gate_proj, up_proj, down_proj, shared,
            _moe_decode_blocks(gate_proj.dtype),
        )  # fmt: skip
    except ValueError:
        return False
    return True


def _moe_decode_mgpu(args, shared) -> bool:
    if not MOE_DECODE_MGPU or args[0].shape[0] > MOE_DECODE_MAX_TOKENS:
        return False
    try:
        moe_kernels.check_decode_mgpu(
            *args, shared, MOE_DECODE_MGPU_BLOCKS, _interpret()
        )  # fmt: skip
    except ValueError:
        return False
    return True


def _moe_small(experts) -> bool:
    return experts.shape[0] * experts.shape[1] <= MOE_SMALL_M.max_pairs


def _moe_grouped_blocks(experts, weights_dtype) -> moe_kernels.GroupedBlocks:
    """The grouped kernels' tiles for a call (the comment above ``MOE_SMALL_M``)."""
    if jnp.dtype(weights_dtype).itemsize != 2:
        return MOE_GROUPED
    few = experts.shape[0] * experts.shape[1] <= MOE_FEW_PAIRS
    return MOE_GROUPED_FEW if few else MOE_GROUPED_MANY


def _moe_auto(x, weights, experts, gate_proj, up_proj, down_proj) -> bool:
    """``"auto"`` takes the MoE kernels wherever they take the inputs (``H`` and ``I``
    multiples of 16, float32 / bfloat16 / float16): on the H200 at Qwen3.5-35B-A3B's MoE
    (E 256, top-8, H 2048, I 512, bf16; ``python -m benchmarks.moe``) the small-M kernels ran
    8.1x (M 1) and 2.6x (M 16) faster than the XLA path, the grouped kernels 15x (M 464) and
    60x (M 2048)."""
    args = (x, weights, experts, gate_proj, up_proj, down_proj)
    try:
        if _moe_small(experts):
            moe_kernels.check_small_m(*args, MOE_SMALL_M)
        else:
            moe_kernels.check_grouped(*args, _moe_grouped_blocks(experts, gate_proj.dtype))
    except ValueError:
        return False
    return True


def route_topk(logits, k, *, normalize=True, dtype=jnp.float32, num_experts=None):
    """The router's top-k in one kernel (:func:`pallas_kernels.moe.route.route_topk`)."""
    from pallas_kernels.moe.route import route_topk as kernel

    return kernel(
        logits, k, normalize=normalize, dtype=jnp.dtype(dtype), num_experts=num_experts,
        interpret=_interpret(),
    )  # fmt: skip


def balanced_route(logits, k, *, normalize=True, dtype=jnp.float32, num_experts=None):
    """A benchmark's stand-in router in one kernel (:func:`gdn_jax.moe.balanced_route`:
    :func:`pallas_kernels.moe.route.route_topk` with ``balanced``)."""
    from pallas_kernels.moe.route import route_topk as kernel

    return kernel(
        logits, k, normalize=normalize, dtype=jnp.dtype(dtype), num_experts=num_experts,
        balanced=True, interpret=_interpret(),
    )  # fmt: skip


def _route_auto(logits, k) -> bool:
    """``"auto"`` takes the route kernel wherever it takes the logits: one kernel where XLA runs
    a sort, a slice and a softmax fusion (``balanced_route``: a gather and a softmax fusion)
    (``benchmarks/step_kernels.py`` counts them; not timed on the H200)."""
    from pallas_kernels.moe.route import check_route

    try:
        check_route(logits, k)
    except ValueError:
        return False
    return True


def snapshot_tree_verify(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    """``(o, per-node states)`` of the snapshot baseline (see
    :func:`gdn_jax.snapshot_tree_verify`): one fused kernel per layer where the XLA path runs a
    loop of several kernels per node."""
    return pallas_kernels.snapshot_verify(
        q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
        interpret=_interpret(),
    )  # fmt: skip


def _snapshot_auto(q, k, v) -> bool:
    """``"auto"``: power-of-two head dims (the kernel's value-column blocks)."""
    return _pow2_dim(k.shape[3]) and _pow2_dim(v.shape[3])


def add_rms_norm(x, delta, weight, *, eps):
    """A residual add and RMSNorm in one kernel (:func:`pallas_kernels.norm.add_rms_norm`)."""
    from pallas_kernels.norm import add_rms_norm as kernel

    return kernel(x, delta, weight, eps=float(eps), interpret=_interpret())


# Rows up to which "auto" runs the residual add and RMSNorm as its one kernel. At one row XLA
# runs the norm as a reduction to a scalar and a scaling kernel (two launches, and the add in
# a third where no producer takes it); from two rows it fuses the norm into one kernel and the
# add into its producer, so the kernel saves no launch (deviceless H200 compiles:
# benchmarks/step_kernels.py).
AUTO_NORM_MAX_ROWS = 1


def _norm_auto(x, delta, weight) -> bool:
    """``"auto"`` takes the norm kernel for at most :data:`AUTO_NORM_MAX_ROWS` rows where it
    takes them and ``delta`` has ``x``'s dtype (the kernel stores the sum in ``x``'s dtype)."""
    from pallas_kernels.norm import check_norm

    if x.shape[0] > AUTO_NORM_MAX_ROWS or (delta is not None and delta.dtype != x.dtype):
        return False
    try:
        check_norm(x, delta, weight)
    except ValueError:
        return False
    return True


PALLAS_OPS.update(
    routed_experts=routed_experts,
    route_topk=route_topk,
    balanced_route=balanced_route,
    snapshot_tree_verify=snapshot_tree_verify,
    add_rms_norm=add_rms_norm,
)
AUTO_PALLAS.update(
    routed_experts=_moe_auto,
    route_topk=_route_auto,
    balanced_route=_route_auto,
    snapshot_tree_verify=_snapshot_auto,
    add_rms_norm=_norm_auto,
)
