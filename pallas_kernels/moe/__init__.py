"""Routed mixture-of-experts FFN (SwiGLU experts, top-k routing, weighted combine):

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) ),   e = experts[m, j]

- ``decode.py``: one or a few tokens (decode). One kernel per call: each pair's expert, gate
  and up with SiLU and the routing weight, then its down projection, as f32 partial rows
  summed per token (and a shared expert's down projection alongside);
- ``small_m.py``: few tokens (decode, verify). No routing plan in XLA; one program per first
  pair of each touched expert and column tile, so each touched expert's weights are read once;
  gate and up fused with SiLU and the routing weight, then the down projection;
- ``grouped.py``: many tokens (prefill). Pairs sorted by expert into expert-aligned row blocks
  (XLA, on device), then the same two fused kernels as a grouped GEMM over the blocks;
- ``decode_mgpu.py``: the decode kernel's contract as one Mosaic GPU kernel (TMA copies through
  one shared-memory ring, ``wgmma`` with the weights as the 64-row operand); 2-byte weights, up
  to 8 tokens; a Hopper GPU or Mosaic GPU's interpret mode; built, not yet timed, not routed by
  default (``gdn_jax.pallas_routes.MOE_DECODE_MGPU``);
- ``mgpu.py``: the same routing through jax's Mosaic GPU ``ragged_dot_mgpu`` (a Hopper GPU, or
  Mosaic GPU's interpret mode);
- ``reference.py``: dense plain-JAX reference.

The Triton kernels (``decode``, ``small_m``, ``grouped``) take ``interpret=`` and run on CPU in
interpret mode. Each combines a token's ``k`` weighted pair rows in one XLA reduction.
"""

from pallas_kernels.moe.decode import (
    DEFAULT_DECODE_BLOCKS,
    DecodeBlocks,
    SharedGLU,
    check_decode,
    routed_experts_decode,
)
from pallas_kernels.moe.decode_mgpu import (
    DEFAULT_MGPU_DECODE_BLOCKS,
    MgpuDecodeBlocks,
    check_decode_mgpu,
    routed_experts_decode_mgpu,
)
from pallas_kernels.moe.grouped import (
    DEFAULT_GROUPED_BLOCKS,
    GroupedBlocks,
    check_grouped,
    routed_experts_grouped,
)
from pallas_kernels.moe.mgpu import (
    DEFAULT_MGPU_BLOCKS,
    MgpuBlocks,
    mgpu_available,
    routed_experts_mgpu,
)
from pallas_kernels.moe.small_m import (
    DEFAULT_SMALL_M_BLOCKS,
    SmallMBlocks,
    check_small_m,
    routed_experts_small_m,
)

__all__ = [
    "DEFAULT_DECODE_BLOCKS",
    "DecodeBlocks",
    "SharedGLU",
    "check_decode",
    "routed_experts_decode",
    "DEFAULT_GROUPED_BLOCKS",
    "DEFAULT_MGPU_BLOCKS",
    "DEFAULT_SMALL_M_BLOCKS",
    "GroupedBlocks",
    "MgpuBlocks",
    "SmallMBlocks",
    "check_grouped",
    "check_small_m",
    "mgpu_available",
    "routed_experts_grouped",
    "routed_experts_mgpu",
    "DEFAULT_MGPU_DECODE_BLOCKS",
    "MgpuDecodeBlocks",
    "check_decode_mgpu",
    "routed_experts_decode_mgpu",
    "routed_experts_small_m",
]
