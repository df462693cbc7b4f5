"""Pallas GPU kernels (Triton lowering) for the gated delta rule: tree WY verify and commit,
chunked prefill, and the per-node snapshot verify baseline. Imports jax only (DESIGN.md section 5).

Each op lives in its own module with a frozen dataclass of static tuning knobs, a kernel body that
takes refs, and a thin wrapper that builds the grid and takes ``interpret=`` so CPU CI runs it.
"""

from pallas_kernels.chunk import GPU_MAX_CHUNK, ChunkBlocks, chunk_gated_delta_rule
from pallas_kernels.snapshot_verify import SnapshotBlocks, snapshot_verify
from pallas_kernels.tree_commit import CommitBlocks, tree_commit
from pallas_kernels.tree_verify import (
    GPU_MAX_NODES_X3,
    MAX_NODES,
    VerifyBlocks,
    ancestor_mask,
    tree_verify,
)

__all__ = [
    "GPU_MAX_CHUNK",
    "GPU_MAX_NODES_X3",
    "MAX_NODES",
    "ChunkBlocks",
    "CommitBlocks",
    "SnapshotBlocks",
    "VerifyBlocks",
    "ancestor_mask",
    "chunk_gated_delta_rule",
    "snapshot_verify",
    "tree_commit",
    "tree_verify",
]

# The three-kernel chunked prefill (intra-chunk solve, state recurrence, outputs; chunk 64).
from pallas_kernels.chunk_v2 import ChunkV2Blocks  # noqa: E402
from pallas_kernels.chunk_v2 import chunk_gated_delta_rule as chunk_gated_delta_rule_v2  # noqa: E402

__all__ += ["ChunkV2Blocks", "chunk_gated_delta_rule_v2"]

# One decode token on GDN states read from / written into the serving memory arena in place.
from pallas_kernels.arena_decode import recurrent_step as arena_recurrent_step  # noqa: E402

__all__ += ["arena_recurrent_step"]

# The tree verify in two kernels (per-head N x N matrices, then the value columns): an experiment.
from pallas_kernels.tree_verify_split import SplitVerifyBlocks, tree_verify_split  # noqa: E402

__all__ += ["SplitVerifyBlocks", "tree_verify_split"]
