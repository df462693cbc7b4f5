"""Pallas kernels for the gated delta rule and the hybrid model's attention, one folder per op.

- :mod:`pallas_kernels.verify`: tree WY verify of a draft tree (``kernel.py``), the same verify
  reading its initial states in place from the serving memory arena (``arena.py``), and the
  per-node snapshot verify baseline (``snapshot.py``);
- :mod:`pallas_kernels.commit`: commit of an accepted chain, dense (``kernel.py``) or in place
  on the arena (``arena.py``);
- :mod:`pallas_kernels.chunk`: the chunked prefill (three kernels);
- :mod:`pallas_kernels.decode`: token-by-token steps on arena states (decode, short prefill);
- :mod:`pallas_kernels.attention`: paged tree attention (``kernel.py``) and tree / causal paged
  attention reading KV pages in place from the arena (``arena.py``);
- :mod:`pallas_kernels.moe`: routed MoE experts (small-M, grouped GEMM, ``ragged_dot_mgpu``);
- :mod:`pallas_kernels.experimental`: variants that were measured and are not routed;
- :mod:`pallas_kernels.tpu`: Mosaic TPU versions of the GDN kernels (verify, commit, chunked
  prefill, decode; dense and on the arena) and a route to jax's megablox ``gmm``, checked in
  TPU interpret mode.

Each op folder holds a plain-JAX ``reference.py`` the kernels are tested against. Static tuning
knobs live in frozen dataclasses (``VerifyBlocks``, ``CommitBlocks``, ``ChunkBlocks``, ...); a
thin wrapper builds the grid and takes ``interpret=`` so the kernels run on CPU too. The GPU
kernels use the Pallas Triton lowering, the TPU kernels Mosaic. This package imports jax only,
never ``gdn_jax``.
"""

from pallas_kernels.chunk import ChunkBlocks, chunk_gated_delta_rule
from pallas_kernels.commit import CommitBlocks, tree_commit
from pallas_kernels.verify import (
    GPU_MAX_NODES_X3,
    MAX_NODES,
    SnapshotBlocks,
    VerifyBlocks,
    ancestor_mask,
    snapshot_verify,
    tree_verify,
)

__all__ = [
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
