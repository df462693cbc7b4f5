"""The contract between the step functions and a cache storage: :class:`StepCache`.

:mod:`gdn_jax.models.steps` touches a cache only through the members of :class:`StepCache`.
Two storages implement it: :class:`gdn_jax.models.cache.ModelCache` (per-layer arrays) and the
serving engine's ``serving.arena_cache.ArenaCache`` (the memory manager's arena, read and
written through its handle table).

Shapes (``B`` rows): GDN layer ``gi`` (``0 <= gi < Lg``, in layer order) has the conv state
``conv [B, W-1, C]`` (model dtype: the last ``W-1`` pre-conv inputs) and the recurrent state
``ssm [B, Hv, K, V]`` (f32); attention layer ``ai`` (``0 <= ai < La``) takes K/V
``[B, T, Hkv, D]`` at token positions ``[B, T]`` and queries ``q [B, T, Hq, D]``.

The four GDN hooks (:meth:`StepCache.gdn_step_rule`, :meth:`StepCache.gdn_prefill_rule`,
:meth:`StepCache.gdn_tree_rule`, :meth:`StepCache.commit_gdn_state`) let a storage read and
write GDN layer ``gi``'s recurrent state itself (e.g. a kernel working on it in place). Each
returns ``None`` to take the default XLA path: the step function reads the state with
:meth:`StepCache.gdn_state`, runs the model's own rule on it and writes it back with
:meth:`StepCache.with_gdn_state`. When a hook answers, the step function reads and writes only
that layer's conv state (:meth:`StepCache.gdn_conv_state`,
:meth:`StepCache.with_gdn_conv_state`). The attention hook
(:meth:`StepCache.attention_decode_rule`) lets it run an attention layer's decode step from the
fused projection output to the queries and write the token's K/V itself (else
:meth:`StepCache.write_kv` after the model's own projection).
"""

from __future__ import annotations

from typing import Protocol, Self, runtime_checkable

import jax

from gdn_jax import TreeCache


class SequenceRule(Protocol):
    """A GDN rule that finds layer ``gi``'s recurrent state in the cache itself (what
    :meth:`StepCache.gdn_step_rule` and :meth:`StepCache.gdn_prefill_rule` return).

    Takes ``q, k [B, T, Hv, K]``, ``v [B, T, Hv, V]``, ``g, beta [B, T, Hv]`` (after the conv);
    returns the output ``o [B, T, Hv, V]`` and the cache holding the updated state. It may also
    carry a ``raw`` attribute (the same rule on the layer's raw inputs) and a ``conv`` attribute
    (the rule also runs the conv on its state in place; the step then neither reads nor writes
    the conv state): :meth:`gdn_jax.models.gdn.GatedDeltaNet.__call__` says when they are
    used."""

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        *,
        use_qk_l2norm: bool,
    ) -> tuple[jax.Array, StepCache]: ...


class TreeRule(Protocol):
    """A tree-verify rule that reads layer ``gi``'s recurrent state in the cache itself (what
    :meth:`StepCache.gdn_tree_rule` returns).

    Takes the ``N`` draft nodes' ``q, k [B, N, Hv, K]``, ``v [B, N, Hv, V]``, ``g, beta
    [B, N, Hv]`` and ``parents int32 [B, N]``; returns ``o [B, N, Hv, V]`` and the layer's
    :class:`TreeCache` for the commit."""

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        parents: jax.Array,
        *,
        use_qk_l2norm: bool,
    ) -> tuple[jax.Array, TreeCache]: ...


@runtime_checkable
class StepCache(Protocol):
    """What the step functions call on a cache (module docstring). Every ``with_*`` /
    ``write_*`` method returns a new cache of the same type; none modifies ``self``."""

    lengths: jax.Array
    """``int32 [B]``: committed tokens ``L`` per row."""

    def gdn_state(self, gi: int) -> tuple[jax.Array, jax.Array]:
        """``(conv [B, W-1, C], ssm [B, Hv, K, V])`` of GDN layer ``gi``."""
        ...

    def with_gdn_state(self, gi: int, conv: jax.Array, ssm: jax.Array) -> Self:
        """The cache with GDN layer ``gi``'s ``conv [B, W-1, C]`` and ``ssm [B, Hv, K, V]``."""
        ...

    def gdn_conv_state(self, gi: int) -> jax.Array:
        """``conv [B, W-1, C]`` of GDN layer ``gi`` (read when a hook handles its ``ssm``)."""
        ...

    def with_gdn_conv_state(self, gi: int, conv: jax.Array) -> Self:
        """The cache with GDN layer ``gi``'s ``conv [B, W-1, C]`` (its ``ssm`` untouched)."""
        ...

    def write_kv(
        self, ai: int, positions: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array
    ) -> Self:
        """The cache with attention layer ``ai``'s ``k, v [B, T, Hkv, D]`` written at token
        ``positions int32 [B, T]`` where ``valid bool [B, T]``."""
        ...

    def attention(
        self,
        ai: int,
        q: jax.Array,
        kv_len: jax.Array,
        q_pos: jax.Array,
        *,
        scale: float,
        draft_k: jax.Array | None = None,
        draft_v: jax.Array | None = None,
        draft_mask: jax.Array | None = None,
    ) -> jax.Array:
        """``o [B, T, Hq, D]``: attention of ``q [B, T, Hq, D]`` at positions ``q_pos int32
        [B, T]`` over attention layer ``ai``'s committed K/V (the first ``kv_len int32 [B]``
        positions, causal in ``q_pos``), plus, when given, the draft nodes' ``draft_k, draft_v
        [B, N, Hkv, D]`` where ``draft_mask bool [B, T, N]``
        (:func:`gdn_jax.models.tree_attention.paged_attention`)."""
        ...

    def with_lengths(self, lengths: jax.Array) -> Self:
        """The cache with ``lengths int32 [B]``."""
        ...

    def gdn_step_rule(self, gi: int) -> SequenceRule | None:
        """The one-token (decode) rule of GDN layer ``gi`` on ``[B, 1, ...]`` inputs, reading and
        writing its recurrent state itself; returns None to take the default XLA path."""
        ...

    def attention_decode_rule(self, ai: int):
        """Attention layer ``ai``'s one-token (decode) step from its fused projection output to
        its queries, writing the token's K/V itself: a callable ``rule(proj [B, C], positions
        [B], valid [B], **layer) -> (q [B, Hq, D], cache) | None``
        (:meth:`gdn_jax.models.attention.Attention.project_decode` gives ``layer``: the head
        norms' weights and the rotary and head dims; ``None`` back: that layer takes the default
        path), or None to take the default path (:meth:`write_kv` after the model's own
        projection)."""
        ...

    def gdn_prefill_rule(self, gi: int, num_tokens: jax.Array) -> SequenceRule | None:
        """The rule of GDN layer ``gi`` for ``T > 1`` tokens per row (the first ``num_tokens
        int32 [B]`` of each row live), reading its initial recurrent state and writing the final
        one itself; returns None to take the default XLA path."""
        ...

    def gdn_tree_rule(self, gi: int, n: int) -> TreeRule | None:
        """The tree-verify rule of GDN layer ``gi`` for a tree of ``n`` nodes, reading its
        recurrent state itself (the cache is not modified); returns None to take the default
        XLA path."""
        ...

    def commit_gdn_state(
        self, gi: int, tc: TreeCache, path: jax.Array, path_len: jax.Array
    ) -> Self | None:
        """The cache with GDN layer ``gi``'s recurrent state advanced along the accepted
        ``path int32 [B, D]`` (node ids, the first ``path_len int32 [B]`` of each row) of the
        verified tree ``tc``, committed by the storage itself (its conv state is left to the
        caller); returns None to take the default XLA path."""
        ...
