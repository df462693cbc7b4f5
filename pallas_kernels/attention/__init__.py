"""Paged attention for the hybrid model's attention layers: tree attention over a page table
(``kernel.py``), tree and causal paged attention reading KV pages in place from the serving
memory arena (``arena.py``), and a plain-JAX reference (``reference.py``)."""

from pallas_kernels.attention.kernel import TreeAttentionBlocks, tree_attention

__all__ = ["TreeAttentionBlocks", "tree_attention"]
