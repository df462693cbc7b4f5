"""The vLLM/SGLang verification method in the same engine: every draft node of every GDN layer
keeps a full recurrent state ``[Hv, K, V]`` (``snapshot_tree_verify``), and commit copies the
accepted leaf's snapshot. Attention, conv and the KV commit are those of tree WY, so both
methods see identical logits and accept identical tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax import (
    ancestor_closure,
    snapshot_tree_commit,
    snapshot_tree_verify,
    tree_causal_conv1d,
    tree_conv_commit,
)
from gdn_jax.models import steps
from gdn_jax.models.cache import ModelCache, TreeState
from gdn_jax.models.config import LINEAR
from gdn_jax.models.model import HybridLM
from gdn_jax.models.tree_attention import paged_attention


@dataclasses.dataclass(frozen=True)
class SnapshotState:
    snapshots: jax.Array  # [Lg, B, N, Hv, K, V] f32: one state per node per GDN layer
    conv_in: jax.Array  # [Lg, B, N, C]
    draft_k: jax.Array  # [La, B, N, Hkv, D]
    draft_v: jax.Array


jax.tree_util.register_dataclass(
    SnapshotState, data_fields=["snapshots", "conv_in", "draft_k", "draft_v"], meta_fields=[]
)


def verify_tree_snapshot(model: HybridLM, tokens: jax.Array, parents: jax.Array, cache: ModelCache):
    """Like :func:`gdn_jax.models.steps.verify_tree`: ``(logits [B,N,V], SnapshotState,
    hidden [B,N,H])``, GDN layers by per-node snapshots."""
    b, n = tokens.shape
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    incl = ancestor_closure(parents)
    positions = cache.lengths[:, None] + jnp.sum(incl, axis=-1, dtype=jnp.int32) - 1
    snaps, conv_in, dks, dvs = [], [], [], []
    gi = ai = 0
    x = model.embed(tokens)
    for layer in model.layers:
        h = layer.input_layernorm(x)
        if layer.layer_type == LINEAR:
            gdn = layer.linear_attn
            qkv, z, g, beta = gdn.project(h)
            mixed = tree_causal_conv1d(qkv, parents, cache.conv[gi], gdn.conv_weight[...])
            q, k, v = gdn.split(mixed)
            o, s = snapshot_tree_verify(
                q, k, v, g, beta, parents, cache.ssm[gi], use_qk_l2norm=True
            )
            out = gdn.finish(o, z)
            snaps.append(s)
            conv_in.append(qkv)
            gi += 1
        else:
            attn = layer.self_attn
            q, k, v, gate = attn.project(h, positions)
            o = paged_attention(
                q,
                cache.k_pages[ai],
                cache.v_pages[ai],
                cache.page_table,
                cache.lengths,
                positions,
                scale=attn.scale,
                draft_k=k,
                draft_v=v,
                draft_mask=incl,
            )
            dks.append(k)
            dvs.append(v)
            out = attn.finish(o, gate)
            ai += 1
        x = layer.ffn(x + out)
    stack = lambda xs: jnp.stack(xs) if xs else jnp.zeros((0,), jnp.float32)  # noqa: E731
    state = SnapshotState(stack(snaps), stack(conv_in), stack(dks), stack(dvs))
    hidden = model.norm(x)
    return model.logits(hidden), state, hidden


def commit_snapshot(
    cache: ModelCache, state: SnapshotState, path: jax.Array, path_len: jax.Array
) -> ModelCache:
    """The cache after accepting ``path[b, :path_len[b]]``: each GDN layer's state is the
    accepted leaf's snapshot; conv and KV as in :func:`gdn_jax.models.steps.commit`."""
    kv_only = TreeState((), state.conv_in, state.draft_k, state.draft_v)
    out = steps.commit(cache, kv_only, path, path_len)
    ssm, conv = out.ssm, out.conv
    for gi in range(state.snapshots.shape[0]):
        ssm = ssm.at[gi].set(
            snapshot_tree_commit(cache.ssm[gi], state.snapshots[gi], path, path_len)
        )
        conv = conv.at[gi].set(tree_conv_commit(state.conv_in[gi], cache.conv[gi], path, path_len))
    return dataclasses.replace(out, ssm=ssm, conv=conv)
