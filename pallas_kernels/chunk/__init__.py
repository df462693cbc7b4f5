"""Chunked prefill of the gated delta rule (three kernels, ``kernel.py``) and a plain-JAX
reference (``reference.py``)."""

from pallas_kernels.chunk.kernel import ChunkBlocks, chunk_gated_delta_rule

__all__ = ["ChunkBlocks", "chunk_gated_delta_rule"]
