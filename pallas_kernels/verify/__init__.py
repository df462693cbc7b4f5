"""Tree WY verify of a draft tree through one GDN layer: the fused kernel (``kernel.py``), the
same kernel on states in the serving memory arena (``arena.py``), the per-node snapshot verify
baseline (``snapshot.py``), a Mosaic GPU version of the fused kernel (``mgpu.py``, not routed)
and a plain-JAX reference (``reference.py``)."""

from pallas_kernels.verify.kernel import (
    GPU_MAX_NODES_X3,
    MAX_NODES,
    VerifyBlocks,
    ancestor_mask,
    tree_verify,
)
from pallas_kernels.verify.snapshot import SnapshotBlocks, snapshot_verify

__all__ = [
    "GPU_MAX_NODES_X3",
    "MAX_NODES",
    "SnapshotBlocks",
    "VerifyBlocks",
    "ancestor_mask",
    "snapshot_verify",
    "tree_verify",
]
