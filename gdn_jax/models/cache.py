"""Cache pytrees of the step functions: GDN states, paged KV, and a verified draft tree.

``ModelCache`` (per request row ``b``; GDN layers stacked on axis 0 in layer order, attention
layers likewise):

- ``conv [Lg, B, W-1, C]`` (model dtype): the last ``W-1`` pre-conv inputs of each GDN layer;
- ``ssm [Lg, B, Hv, K, V]`` (f32): the recurrent states;
- ``k_pages, v_pages [La, P, S, Hkv, D]``: one page pool per attention layer;
- ``page_table int32 [B, MP]``: row ``b``'s logical page ``j`` is physical page
  ``page_table[b, j]`` (all layers share it; ``-1`` = unmapped);
- ``lengths int32 [B]``: committed tokens ``L`` per row.

``TreeState`` is what ``verify_tree`` hands to ``commit``: per GDN layer a :class:`TreeCache`
and the pre-conv inputs of the nodes, per attention layer the draft K/V of the nodes.

``ModelCache`` implements :class:`gdn_jax.models.cache_protocol.StepCache`, the contract the
step functions call; its in-place hooks all return ``None`` (the default XLA path). Another
storage implementing the contract works too: the serving engine's arena-backed cache
(``serving.arena_cache.ArenaCache``) reads and writes the memory manager's arena through its
handle table instead of these per-layer arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax import TreeCache
from gdn_jax.models.cache_protocol import SequenceRule, TreeRule
from gdn_jax.models.config import ModelConfig
from gdn_jax.models.tree_attention import paged_attention, write_pages


@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The cache as per-layer arrays (module docstring); a
    :class:`gdn_jax.models.cache_protocol.StepCache`."""

    conv: jax.Array
    ssm: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array

    def gdn_state(self, gi: int) -> tuple[jax.Array, jax.Array]:
        """``(conv [B, W-1, C], ssm [B, Hv, K, V])`` of GDN layer ``gi``."""
        return self.conv[gi], self.ssm[gi]

    def with_gdn_state(self, gi: int, conv: jax.Array, ssm: jax.Array) -> ModelCache:
        return dataclasses.replace(
            self, conv=self.conv.at[gi].set(conv), ssm=self.ssm.at[gi].set(ssm)
        )

    def gdn_conv_state(self, gi: int) -> jax.Array:
        """``conv [B, W-1, C]`` of GDN layer ``gi``."""
        return self.conv[gi]

    def with_gdn_conv_state(self, gi: int, conv: jax.Array) -> ModelCache:
        return dataclasses.replace(self, conv=self.conv.at[gi].set(conv))

    def write_kv(
        self, ai: int, positions: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array
    ) -> ModelCache:
        """Attention layer ``ai``'s ``k, v [B, T, Hkv, D]`` written at ``positions [B, T]``
        where ``valid`` (see :func:`write_pages`)."""
        kp = write_pages(self.k_pages[ai], self.page_table, positions, k, valid)
        vp = write_pages(self.v_pages[ai], self.page_table, positions, v, valid)
        return dataclasses.replace(
            self, k_pages=self.k_pages.at[ai].set(kp), v_pages=self.v_pages.at[ai].set(vp)
        )

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
        """:func:`paged_attention` of ``q`` over attention layer ``ai``'s committed KV."""
        return paged_attention(
            q,
            self.k_pages[ai],
            self.v_pages[ai],
            self.page_table,
            kv_len,
            q_pos,
            scale=scale,
            draft_k=draft_k,
            draft_v=draft_v,
            draft_mask=draft_mask,
        )

    def with_lengths(self, lengths: jax.Array) -> ModelCache:
        return dataclasses.replace(self, lengths=lengths)

    # The in-place hooks: this storage has none, every GDN layer takes the default XLA path.

    def gdn_step_rule(self, gi: int) -> SequenceRule | None:
        return None

    def attention_decode_rule(self, ai: int):
        return None

    def gdn_prefill_rule(self, gi: int, num_tokens: jax.Array) -> SequenceRule | None:
        return None

    def gdn_tree_rule(self, gi: int, n: int) -> TreeRule | None:
        return None

    def commit_gdn_state(
        self, gi: int, tc: TreeCache, path: jax.Array, path_len: jax.Array
    ) -> ModelCache | None:
        return None


@dataclasses.dataclass(frozen=True)
class TreeState:
    gdn: tuple[TreeCache, ...] | tuple[jax.Array, ...]  # per-node snapshots when verified so
    conv_in: jax.Array  # [Lg, B, N, C]
    draft_k: jax.Array  # [La, B, N, Hkv, D]
    draft_v: jax.Array


jax.tree_util.register_dataclass(
    ModelCache,
    data_fields=["conv", "ssm", "k_pages", "v_pages", "page_table", "lengths"],
    meta_fields=[],
)
jax.tree_util.register_dataclass(
    TreeState, data_fields=["gdn", "conv_in", "draft_k", "draft_v"], meta_fields=[]
)


def contiguous_page_table(batch: int, pages_per_seq: int) -> jax.Array:
    """Row ``b`` owns physical pages ``b * pages_per_seq ...`` (a stand-in for the memory
    manager)."""
    return jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)


def init_cache(
    cfg: ModelConfig,
    batch: int,
    *,
    max_len: int,
    page_size: int = 16,
    num_pages: int | None = None,
    page_table: jax.Array | None = None,
    dtype=jnp.bfloat16,
) -> ModelCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (``L = 0``).

    Without ``page_table``, each row gets its own contiguous run of pages.
    """
    mp = -(-max_len // page_size)
    if page_table is None:
        page_table = contiguous_page_table(batch, mp)
    if num_pages is None:
        num_pages = batch * mp
    lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
    kv = (la, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    return ModelCache(
        conv=jnp.zeros((lg, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
        ssm=jnp.zeros(
            (
                lg,
                batch,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
            ),
            jnp.float32,
        ),
        k_pages=jnp.zeros(kv, dtype),
        v_pages=jnp.zeros(kv, dtype),
        page_table=jnp.asarray(page_table, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )
