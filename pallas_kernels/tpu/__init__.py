"""Mosaic TPU kernels of the gated delta rule, verified in TPU interpret mode off TPU.

- :mod:`pallas_kernels.tpu.verify`: tree WY verify (``tree_verify``), and with the initial
  states read in place from the serving memory arena (``tree_verify_arena``);
- :mod:`pallas_kernels.tpu.commit`: commit of an accepted chain, in place (``tree_commit``,
  ``tree_commit_arena``);
- :mod:`pallas_kernels.tpu.chunk`: the chunked prefill in one kernel (chunks of 64 or 128
  tokens, ``cu_seqlens``), and on recurrent states read and written in place in the serving
  memory arena (``chunk_prefill_arena``, ragged ``num_tokens``);
- :mod:`pallas_kernels.tpu.decode`: token-by-token steps, in place (``recurrent``,
  ``recurrent_step``, ``recurrent_step_arena``);
- :mod:`pallas_kernels.tpu.attention`: paged attention (decode, prefill) and tree attention
  (the tree verify: committed pages, then the draft K/V along each node's path) over KV pages
  read in place from the serving memory arena (``paged_attention_arena``,
  ``tree_attention_arena``; VMEM budgets ``paged_attention_vmem``, ``tree_attention_vmem``);
- :mod:`pallas_kernels.tpu.moe`: the routed MoE experts through jax's megablox ``gmm`` (jax's
  kernel, not ours);
- :mod:`pallas_kernels.tpu._common` / ``_arena``: explicit bf16-split dots, layouts, VMEM
  budgets, Mosaic lowering without a TPU (``lower_for_tpu``), arena addressing.

Every entry point takes the op's ``[B, T, H, D]`` layout (the kernels read head-major blocks,
128 lanes wide), ``blocks=`` knobs in frozen dataclasses and ``interpret=True`` for TPU
interpret mode (``pltpu.InterpretParams``) on any backend.
"""

from pallas_kernels.tpu._common import lower_for_tpu
from pallas_kernels.tpu.attention import (
    paged_attention_arena,
    paged_attention_vmem,
    tree_attention_arena,
    tree_attention_vmem,
)
from pallas_kernels.tpu.chunk import TpuChunkBlocks, chunk_gated_delta_rule, chunk_prefill_arena
from pallas_kernels.tpu.commit import TpuCommitBlocks, tree_commit, tree_commit_arena
from pallas_kernels.tpu.decode import recurrent, recurrent_step, recurrent_step_arena
from pallas_kernels.tpu.moe import routed_experts_gmm
from pallas_kernels.tpu.verify import (
    MAX_NODES,
    TpuVerifyBlocks,
    tree_verify,
    tree_verify_arena,
)

__all__ = [
    "MAX_NODES",
    "TpuChunkBlocks",
    "TpuCommitBlocks",
    "TpuVerifyBlocks",
    "chunk_gated_delta_rule",
    "chunk_prefill_arena",
    "lower_for_tpu",
    "paged_attention_arena",
    "paged_attention_vmem",
    "recurrent",
    "recurrent_step",
    "recurrent_step_arena",
    "routed_experts_gmm",
    "tree_commit",
    "tree_attention_arena",
    "tree_attention_vmem",
    "tree_commit_arena",
    "tree_verify",
    "tree_verify_arena",
]
