"""Commit of an accepted chain of a verified draft tree: dense (``kernel.py``), in place on the
serving memory arena (``arena.py``), and a plain-JAX reference (``reference.py``)."""

from pallas_kernels.commit.kernel import CommitBlocks, tree_commit

__all__ = ["CommitBlocks", "tree_commit"]
