"""Gated DeltaNet in JAX: the gated delta rule (recurrent, chunked), tree WY speculative
verification and commit, short convolutions on sequences and trees (docs/design.md)."""

from gdn_jax.chunk import chunk_gated_delta_rule
from gdn_jax.conv import causal_conv1d, causal_conv1d_update, tree_causal_conv1d, tree_conv_commit
from gdn_jax.moe import balanced_route, route_topk, routed_experts
from gdn_jax.recurrent import recurrent_gated_delta_rule
from gdn_jax.snapshot import snapshot_tree_commit, snapshot_tree_verify
from gdn_jax.tree import DraftTree
from gdn_jax.tree_wy import TreeCache, ancestor_closure, tree_commit, tree_verify

__all__ = [
    "DraftTree",
    "TreeCache",
    "ancestor_closure",
    "balanced_route",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "route_topk",
    "routed_experts",
    "snapshot_tree_commit",
    "snapshot_tree_verify",
    "tree_causal_conv1d",
    "tree_commit",
    "tree_conv_commit",
    "tree_verify",
]
