"""Pure step functions of the hybrid model: caches in, caches out, static shapes.

- :func:`prefill`: ``T`` new tokens per row after the committed ``L`` (chunked GDN, attention
  writing its K/V into the pages at ``L .. L+n-1``);
- :func:`decode`: one token per row (recurrent GDN step);
- :func:`verify_tree`: a draft tree of ``N`` nodes per row through every layer, leaving the
  cache untouched: GDN by ``tree_verify``, conv by ``tree_causal_conv1d``, attention by a tree
  mask over the committed paged KV plus the draft K/V of each node's path, node ``n`` at
  position ``L + depth(n)`` (docs/design.md);
- :func:`commit`: the accepted chain ``path[:path_len]``: GDN by ``tree_commit``, conv by
  ``tree_conv_commit``, the accepted nodes' K/V written at ``L .. L+m-1``, ``L += m``.

Each takes the model first; jit them with ``nnx.jit`` (or split the model and close over the
graph). They touch the cache only through :class:`gdn_jax.models.cache_protocol.StepCache`
(``lengths``, ``gdn_state``, ``with_gdn_state``, ``write_kv``, ``attention``, ``with_lengths``
and the in-place hooks): a :class:`ModelCache` of per-layer arrays, or any storage implementing
the protocol (the serving engine's arena-backed cache). ``verify_tree`` then ``commit`` then
``decode(next)`` equals decoding the accepted tokens one by one.

The hooks let a storage handle GDN layer ``gi``'s recurrent state itself (the serving arena
with its Pallas kernels): a one-token :func:`prefill` / :func:`decode` asks
``cache.gdn_step_rule(gi)`` (a longer :func:`prefill`, ``cache.gdn_prefill_rule(gi,
num_tokens)``) for a rule that reads and writes the state and returns the updated cache;
``verify_tree`` asks ``cache.gdn_tree_rule(gi, N)`` for a tree-verify rule that reads it;
``commit`` asks ``cache.commit_gdn_state(gi, tree_cache, path, path_len)`` to commit it. With
a hook's answer only the conv state goes through the step function
(``gdn_conv_state`` / ``with_gdn_conv_state``); ``None`` takes the default path
(``gdn_state`` / ``with_gdn_state``), which a :class:`ModelCache` always does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax import (
    TreeCache,
    ancestor_closure,
    snapshot_tree_commit,
    tree_commit,
    tree_conv_commit,
)
from gdn_jax.models.cache import TreeState
from gdn_jax.models.cache_protocol import StepCache
from gdn_jax.models.config import LINEAR
from gdn_jax.models.model import HybridLM

# Appends of at most this many tokens per row (decode, a speculative step's catch-up) run the
# token-by-token rule: the chunked form pads every row to a whole chunk (64 tokens).
SHORT_SEQUENCE = 8


def _sequence(
    model: HybridLM,
    tokens: jax.Array,
    cache: StepCache,
    num_tokens: jax.Array,
    *,
    recurrent: bool,
) -> tuple[jax.Array, StepCache]:
    """Normed hidden states ``[B, T, H]`` of ``tokens`` appended at ``cache.lengths``."""
    t = tokens.shape[1]
    start = cache.lengths
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < num_tokens[:, None]
    kv_len = start + num_tokens
    gi = ai = 0
    x, ffn_out = model.embed(tokens), None
    for layer in model.layers:
        x, h = layer.input_layernorm.add(x, ffn_out)  # the residual add fused into the norm
        if layer.layer_type == LINEAR:
            rule = None  # T = 0 takes the default path
            if t == 1:
                rule = cache.gdn_step_rule(gi)
            elif t > 1:
                rule = cache.gdn_prefill_rule(gi, num_tokens)
            if rule is None:
                conv, ssm = cache.gdn_state(gi)
                mixed, c, s = layer.linear_attn(
                    h, conv, ssm, num_tokens=num_tokens, recurrent=recurrent
                )
                cache = cache.with_gdn_state(gi, c, s)
            else:  # the rule reads and writes the recurrent state in place
                # (and the conv state too, when the layer takes the rule's conv form)
                owns_conv = layer.linear_attn.takes_conv(rule)
                conv = None if owns_conv else cache.gdn_conv_state(gi)
                mixed, c, cache = layer.linear_attn(h, conv, None, num_tokens=num_tokens, rule=rule)
                if c is not None:
                    cache = cache.with_gdn_conv_state(gi, c)
            gi += 1
        else:
            attn = layer.self_attn
            rule = cache.attention_decode_rule(ai) if t == 1 else None
            pre = None if rule is None else attn.project_decode(h, positions, valid, rule)
            if pre is None:
                q, k, v, gate = attn.project(h, positions)
                cache = cache.write_kv(ai, positions, k, v, valid)
            else:  # the rule wrote the token's K/V in place
                q, gate, cache = pre
            o = cache.attention(ai, q, kv_len, positions, scale=attn.scale)
            mixed = attn.finish(o, gate)
            ai += 1
        x, ffn_out = _ffn(layer, x, mixed)
    return model.norm.add(x, ffn_out)[1], cache.with_lengths(kv_len.astype(jnp.int32))


def _ffn(layer, x: jax.Array, mixed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x + mixed, mlp(norm(x + mixed)))``: a layer's feed-forward half with its output not
    yet added, so the next norm adds it (``RMSNorm.add``: add and norm in one kernel on a GPU);
    ``s + out`` is ``layer.ffn(x + mixed)``."""
    s, h = layer.post_attention_layernorm.add(x, mixed)
    return s, layer.mlp(h)


def prefill(
    model: HybridLM,
    tokens: Int[Array, "B T"],
    cache: StepCache,
    num_tokens: Int[Array, " B"] | None = None,
    *,
    all_logits: bool = False,
    return_hidden: bool = False,
):
    """Appends ``tokens[b, :num_tokens[b]]`` (default: all ``T``) to each row.

    Returns ``(logits, cache)``: logits ``[B, T, V]`` when ``all_logits`` (rows past
    ``num_tokens`` unspecified), else ``[B, V]`` at each row's last new token. With
    ``return_hidden``, also the normed hidden states at the same positions (the MTP drafter's
    input): ``(logits, cache, hidden)``.
    """
    b, t = tokens.shape
    if num_tokens is None:
        num_tokens = jnp.full((b,), t, jnp.int32)
    num_tokens = num_tokens.astype(jnp.int32)
    hidden, cache = _sequence(model, tokens, cache, num_tokens, recurrent=t <= SHORT_SEQUENCE)
    if not all_logits:
        hidden = jnp.take_along_axis(hidden, jnp.maximum(num_tokens - 1, 0)[:, None, None], axis=1)[
            :, 0
        ]
    if return_hidden:
        return model.logits(hidden), cache, hidden
    return model.logits(hidden), cache


def decode(
    model: HybridLM, tokens: Int[Array, " B"], cache: StepCache
) -> tuple[Float[Array, "B V"], StepCache]:
    """One token per row: ``(logits [B, V], cache)`` with ``lengths + 1``."""
    b = tokens.shape[0]
    hidden, cache = _sequence(
        model, tokens[:, None], cache, jnp.ones((b,), jnp.int32), recurrent=True
    )
    return model.logits(hidden[:, 0]), cache


def verify_tree(
    model: HybridLM,
    tokens: Int[Array, "B N"],
    parents: Int[Array, "B N"],
    cache: StepCache,
    *,
    return_hidden: bool = False,
    snapshot: bool = False,
    snapshot_sink=None,
):
    """Logits of every draft node as if its root-to-node path had been decoded after the
    committed tokens; the cache is not modified. Returns ``(logits [B, N, V], TreeState)``,
    and the nodes' normed hidden states ``[B, N, H]`` third with ``return_hidden``.

    ``snapshot=True`` verifies the GDN layers by per-node state snapshots (the vLLM/SGLang
    method; ``TreeState.gdn`` then holds ``[B, N, Hv, K, V]`` states per layer) with everything
    else identical, so both methods give the same logits. ``snapshot_sink`` (with ``snapshot``):
    ``cache = snapshot_sink(cache, layer, states)`` takes each GDN layer's per-node states as
    soon as they are computed (the serving engine writes them into its arena,
    ``ArenaCache.write_snapshot_states``); the later layers read through the cache it returns,
    ``TreeState.gdn`` holds ``None`` per layer, and that cache comes back last."""
    b, n = tokens.shape
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    incl = ancestor_closure(parents)  # [B, N, N]: i on path(n)
    positions = cache.lengths[:, None] + jnp.sum(incl, axis=-1, dtype=jnp.int32) - 1
    gdn, conv_in, dks, dvs = [], [], [], []
    gi = ai = 0
    x, ffn_out = model.embed(tokens), None
    for layer in model.layers:
        x, h = layer.input_layernorm.add(x, ffn_out)
        if layer.layer_type == LINEAR:
            rule = None if snapshot else cache.gdn_tree_rule(gi, n)
            if rule is None:
                conv, ssm = cache.gdn_state(gi)
            else:  # the rule reads the recurrent state in place
                conv, ssm = cache.gdn_conv_state(gi), None
            mixed, tc, qkv = layer.linear_attn.tree(
                h, parents, conv, ssm, snapshot=snapshot, rule=rule
            )
            if snapshot and snapshot_sink is not None:
                cache = snapshot_sink(cache, gi, tc)
                tc = None
            gdn.append(tc)
            conv_in.append(qkv)
            gi += 1
        else:
            attn = layer.self_attn
            q, k, v, gate = attn.project(h, positions)
            o = cache.attention(
                ai,
                q,
                cache.lengths,
                positions,
                scale=attn.scale,
                draft_k=k,
                draft_v=v,
                draft_mask=incl,
            )
            dks.append(k)
            dvs.append(v)
            mixed = attn.finish(o, gate)
            ai += 1
        x, ffn_out = _ffn(layer, x, mixed)
    state = TreeState(tuple(gdn), _stack(conv_in), _stack(dks), _stack(dvs))
    hidden = model.norm.add(x, ffn_out)[1]
    out = (model.logits(hidden), state, hidden) if return_hidden else (model.logits(hidden), state)
    return (*out, cache) if snapshot and snapshot_sink is not None else out


def _stack(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack(xs) if xs else jnp.zeros((0,), jnp.float32)


def commit(
    cache: StepCache,
    tree: TreeState,
    path: Int[Array, "B D"],
    path_len: Int[Array, " B"],
    *,
    impl: str = "auto",
) -> StepCache:
    """The cache after accepting ``path[b, :path_len[b]]`` (node ids, root to leaf); ``impl``
    is :func:`gdn_jax.tree_commit`'s where the cache does not commit in place."""
    path = jnp.asarray(path, jnp.int32)
    path_len = jnp.asarray(path_len, jnp.int32)
    d = path.shape[1]
    # Every layer's conv state is read before any state is committed, and the barrier orders
    # those reads before the commits: a cache committing in place (the arena) would otherwise
    # see a read of layer i's conv state unordered against layer i + 1's in-place commit and
    # copy the whole buffer to keep the read's version.
    convs = [cache.gdn_conv_state(gi) for gi in range(len(tree.gdn))]
    cache, convs = jax.lax.optimization_barrier((cache, convs))
    for gi, tc in enumerate(tree.gdn):
        conv = convs[gi]
        if isinstance(tc, TreeCache):
            committed = cache.commit_gdn_state(gi, tc, path, path_len)
            if committed is not None:  # the recurrent state committed in place
                new_conv = tree_conv_commit(tree.conv_in[gi], conv, path, path_len)
                cache = committed.with_gdn_conv_state(gi, new_conv)
                continue
        _, ssm = cache.gdn_state(gi)
        if isinstance(tc, TreeCache):
            new_state = tree_commit(ssm, tc, path, path_len, impl=impl)
        else:  # per-node snapshots: the accepted leaf's state
            new_state = snapshot_tree_commit(ssm, tc, path, path_len)
        new_conv = tree_conv_commit(tree.conv_in[gi], conv, path, path_len)
        cache = cache.with_gdn_state(gi, new_conv, new_state)
    num_attn = tree.draft_k.shape[0] if tree.draft_k.ndim > 1 else 0
    if num_attn:
        n = tree.draft_k.shape[2]
        node = jnp.clip(path, 0, n - 1)[:, :, None, None]
        positions = cache.lengths[:, None] + jnp.arange(d, dtype=jnp.int32)[None, :]
        valid = jnp.arange(d)[None, :] < path_len[:, None]
        for ai in range(num_attn):
            k = jnp.take_along_axis(tree.draft_k[ai], node, axis=1)
            v = jnp.take_along_axis(tree.draft_v[ai], node, axis=1)
            cache = cache.write_kv(ai, positions, k, v, valid)
    return cache.with_lengths(cache.lengths + path_len)
