"""Static geometry of a model's cache inside the memory manager's arena: :class:`ArenaSpec`.

Where each GDN layer's recurrent and conv state sits in a ``state`` unit, each attention
layer's K and V in a ``kv`` unit (``[La, 2, S, Hkv, D]``: one page of ``S`` tokens), and the
speculative scratch in a ``stash`` / ``snapshot`` unit, as word offsets inside the unit, read
from the manager's layout (:func:`serving.memory.layout_for`). The arena cache
(:class:`serving.arena_cache.ArenaCache`) and the kernel selection
(:func:`serving.kernels.select_kernels`) take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from serving.memory.layout import WORD_BYTES, Field


@dataclasses.dataclass(frozen=True)
class ArenaSpec:
    """Static geometry of the arena's units as the model's step functions see them (word
    offsets inside a unit; every block the arena cache addresses starts and ends on a word
    boundary)."""

    gdn_layers: int
    state_shape: tuple[int, ...]  # [Hv, K, V] per layer, f32
    state_dtype: str
    state_offset: int  # words of recurrent[0] from the unit start
    conv_shape: tuple[int, ...]  # [W-1, C] per layer
    conv_dtype: str
    conv_offset: int
    attn_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_offset: int
    model_dtype: str
    # the stash unit's fields (u, k, g, x, dk, dv; serving.memory.layout), for the speculative
    # scratch (ArenaCache.write_tree_state / read_tree_state); empty: no scratch in the arena
    stash: tuple[Field, ...] = ()

    @staticmethod
    def from_layout(layout, model_dtype, config=None, *, draft: bool = False) -> ArenaSpec:
        """From the manager's (effective) layout; checks it matches the model ``config``
        (a :class:`gdn_jax.models.ModelConfig`) when given. ``draft=True``: the draft
        model's ``draft_*`` fields of the same units (no speculative scratch)."""
        prefix = "draft_" if draft else ""
        if draft and layout.draft is None:
            raise ValueError("draft=True: the memory layout has no draft model (layout.draft)")

        def named(kind):
            return {
                f.name.removeprefix(prefix): f
                for f in layout.fields(kind)
                if f.name.startswith(prefix) and (draft or not f.name.startswith("draft_"))
            }

        state, kv = named("state"), named("kv")["kv"]
        rec, conv = state["recurrent"], state["conv"]
        lg, la = rec.shape[0], kv.shape[0]
        if config is not None:
            want = {
                "recurrent": (
                    len(config.gdn_layers),
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                ),
                "conv": (
                    len(config.gdn_layers),
                    config.linear_conv_kernel_dim - 1,
                    config.conv_dim,
                ),
                "kv": (
                    len(config.attn_layers),
                    2,
                    layout.page_size,
                    config.num_key_value_heads,
                    config.head_dim,
                ),
            }
            for f in (rec, conv, kv):
                if f.shape != want[f.name.removeprefix(prefix)]:
                    raise ValueError(
                        f"memory layout field {f.name!r} has shape {f.shape}, the model needs "
                        f"{want[f.name.removeprefix(prefix)]}: build the manager with "
                        "layout_for(config, page_size)"
                    )
        spec = ArenaSpec(
            gdn_layers=lg,
            state_shape=rec.shape[1:],
            state_dtype=str(rec.dtype),
            state_offset=rec.word_offset,
            conv_shape=conv.shape[1:],
            conv_dtype=str(conv.dtype),
            conv_offset=conv.word_offset,
            attn_layers=la,
            page_size=layout.page_size,
            kv_heads=kv.shape[3],
            head_dim=kv.shape[4],
            kv_dtype=str(kv.dtype),
            kv_offset=kv.word_offset,
            model_dtype=str(jnp.dtype(model_dtype)),
            stash=() if draft else layout.fields("stash"),
        )
        for name, shape, dtype in (
            ("recurrent", spec.state_shape, spec.state_dtype),
            ("conv", spec.conv_shape, spec.conv_dtype),
            ("kv (one token)", (spec.kv_heads, spec.head_dim), spec.kv_dtype),
        ):
            if math.prod(shape) * jnp.dtype(dtype).itemsize % WORD_BYTES:
                raise ValueError(
                    f"arena cache: one layer's {name} block {shape} {dtype} is not a whole "
                    f"number of {WORD_BYTES}-byte words"
                )
        return spec

    @property
    def state_words(self) -> int:
        return _words(self.state_shape, self.state_dtype)

    @property
    def conv_words(self) -> int:
        return _words(self.conv_shape, self.conv_dtype)

    @property
    def token_words(self) -> int:
        """Words of one token's K (or V) of one attention layer."""
        return _words((self.kv_heads, self.head_dim), self.kv_dtype)

    @property
    def spec_nodes(self) -> int:
        """Draft-tree nodes one ``stash`` unit holds (0: no stash fields)."""
        return self.stash[0].shape[1] if self.stash else 0

    def snapshot_packing(self) -> tuple[int, int, int]:
        """Words of one node's ``(pre-conv inputs [Lg, C], draft K [La, Hkv, D], draft V)``
        as packed at the start of a ``snapshot`` unit's ``conv`` field (whole words each);
        ``ValueError`` when they do not fit in it."""
        c = self.conv_shape[1]
        x = _ceil_words(self.gdn_layers * c, self.conv_dtype)
        kv = _ceil_words(self.attn_layers * self.kv_heads * self.head_dim, self.kv_dtype)
        room = self.gdn_layers * self.conv_words
        if x + 2 * kv > room:
            raise ValueError(
                f"snapshot verify: one node's pre-conv inputs ({x} words) and draft K/V "
                f"({2 * kv} words) do not fit in a snapshot unit's conv field ({room} words); "
                "use the tree-WY verify (stash units)"
            )
        return x, kv, kv


def _words(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize // WORD_BYTES


def _ceil_words(count: int, dtype) -> int:
    """Words ``count`` elements of ``dtype`` take, the last one zero-padded."""
    return -(-count * jnp.dtype(dtype).itemsize // WORD_BYTES)
