"""What one KV page, one state slot and one speculative-scratch unit hold, in bytes and shapes.

A hybrid model has ``La`` full-attention layers and ``Lg`` Gated DeltaNet layers
(docs/design.md). The manager stores four kinds of unit, each at its natural size:

==========  ===========  =============================================================
kind        pool         fields (shape, dtype)
==========  ===========  =============================================================
kv          kv           kv: [La, 2, page_size, Hkv, D] kv_dtype (K and V of page_size tokens)
state       state        recurrent: [Lg, Hv, K, V] f32;  conv: [Lg, conv_kernel-1, conv_dim] bf16
snapshot    state [1]    same as state: one per-draft-node state (the vLLM/SGLang baseline)
stash       stash        u: [Lg, N, Hv, V] f32; k: [Lg, N, Hk, K] kv_dtype; g: [Lg, N, Hv] f32;
                         x: [Lg, N, conv_dim] bf16; dk, dv: [La, N, Hkv, D] kv_dtype
                         (tree-WY stash of N = spec_nodes nodes: u, k, g what tree_commit
                         reads, docs/design.md; x the nodes' pre-conv inputs for the
                         conv commit; dk, dv the attention layers' draft K/V)
==========  ===========  =============================================================

[1] Its own ``snapshot`` pool when a draft model's fields make state slots bigger (below).

The serving engine's arena runner keeps a request's whole speculative scratch (the
``TreeState`` that ``verify_tree`` returns and ``commit`` consumes) in these units: verify
writes it into the request's ``stash`` unit, commit reads it back
(:mod:`serving.arena_cache`). The snapshot method's ``N`` ``snapshot`` units hold, per
node, that node's recurrent states (``recurrent``) and, packed at the start of ``conv``'s words,
its pre-conv inputs ``[Lg, conv_dim]`` then its draft K and V ``[La, Hkv, D]`` each
(``ArenaSpec.snapshot_packing`` checks they fit: ``2 La Hkv D`` kv elements within
``Lg (conv_kernel - 2) conv_dim`` conv elements, true for every Qwen3-Next / Qwen3.5 config).

With a draft model (``HybridLayout.draft``, the serving engine's ``draft_model`` drafter), its
cache shares the target's units, since both models hold the same tokens: a ``kv`` page also
holds ``draft_kv`` (the draft's K and V of the same ``page_size`` tokens) and a ``state`` slot
``draft_recurrent`` and ``draft_conv``, after the target's fields. The draft needs no
speculative scratch (its verify only reads), so ``snapshot`` and ``stash`` units do not change;
a ``snapshot`` unit is then smaller than a state slot and the policies give it a pool of its
own (:meth:`serving.memory.policies.Policy.pool_of_kind`).

``conv_dim = 2 Hk K + Hv V`` (the conv runs over ``[q | k | v]``). Every field starts on a
4-byte word boundary, so the arena can be a ``uint32`` buffer and each field a bitcast view.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax import numpy as jnp

KINDS: tuple[str, ...] = ("kv", "state", "snapshot", "stash")
POOL_OF_KIND: dict[str, str] = {"kv": "kv", "state": "state", "snapshot": "state", "stash": "stash"}
WORD_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Field:
    """One typed array inside a unit: ``words`` uint32 words starting at ``word_offset``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    word_offset: int
    words: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _fields(specs: list[tuple[str, tuple[int, ...], Any]]) -> tuple[Field, ...]:
    out, offset = [], 0
    for name, shape, dtype in specs:
        dtype = np.dtype(dtype)
        words = -(-math.prod(shape) * dtype.itemsize // WORD_BYTES)
        out.append(Field(name, tuple(int(s) for s in shape), dtype, offset, words))
        offset += words
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Per-unit geometry of a hybrid GDN/attention model's cache.

    Attributes:
      page_size: tokens per KV page.
      attn_layers, kv_heads, head_dim: full-attention layers ``La``, KV heads ``Hkv``, ``D``.
      gdn_layers, k_heads, v_heads, key_dim, value_dim: GDN ``Lg``, ``Hk``, ``Hv``, ``K``, ``V``.
      conv_kernel: short-conv kernel width (the conv state keeps ``conv_kernel - 1`` inputs).
      spec_nodes: draft-tree nodes ``N`` covered by one ``stash`` unit.
      kv_dtype, conv_dtype, state_dtype: storage dtypes (bf16, bf16, f32 by default).
      draft: a draft model's layout whose cache shares these units (``draft_`` fields after
        the target's in ``kv`` and ``state`` units); its ``page_size`` and dtypes are this
        layout's, its ``spec_nodes`` unused. ``None``: no draft model.
    """

    page_size: int
    attn_layers: int
    kv_heads: int
    head_dim: int
    gdn_layers: int
    k_heads: int
    v_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    spec_nodes: int = 16
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    state_dtype: str = "float32"
    draft: HybridLayout | None = None

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "attn_layers",
            "kv_heads",
            "head_dim",
            "gdn_layers",
            "k_heads",
            "v_heads",
            "key_dim",
            "value_dim",
            "spec_nodes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"HybridLayout.{name} must be a positive int, got {value!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"HybridLayout.conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.v_heads % self.k_heads:
            raise ValueError(
                f"HybridLayout.v_heads ({self.v_heads}) must be a multiple of "
                f"k_heads ({self.k_heads}) (grouped value heads, docs/design.md)"
            )
        for name in ("kv_dtype", "conv_dtype", "state_dtype"):
            jnp.dtype(getattr(self, name))  # raises TypeError on an unknown dtype name
        if self.draft is not None and (
            not isinstance(self.draft, HybridLayout) or self.draft.draft is not None
        ):
            raise ValueError(
                f"HybridLayout.draft must be a HybridLayout without a draft of its own, got "
                f"{self.draft!r}"
            )

    def _draft_fields(self, kind: str) -> list[tuple[str, tuple[int, ...], Any]]:
        """The draft model's ``draft_*`` field specs in a unit of ``kind`` (``kv`` and
        ``state`` only; none without a draft): its dims at this layout's page size and
        dtypes."""
        if self.draft is None or kind not in ("kv", "state"):
            return []
        d = dataclasses.replace(
            self.draft,
            page_size=self.page_size,
            spec_nodes=self.spec_nodes,
            kv_dtype=self.kv_dtype,
            conv_dtype=self.conv_dtype,
            state_dtype=self.state_dtype,
        )
        return [("draft_" + f.name, f.shape, f.dtype) for f in d.fields(kind)]

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.key_dim + self.v_heads * self.value_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 La Hkv D`` elements of ``kv_dtype``: K and V of every attention layer."""
        itemsize = jnp.dtype(self.kv_dtype).itemsize
        return 2 * self.attn_layers * self.kv_heads * self.head_dim * itemsize

    def fields(self, kind: str) -> tuple[Field, ...]:
        """The typed arrays of one unit of ``kind``, in storage order (first = default)."""
        lg, n = self.gdn_layers, self.spec_nodes
        if kind == "kv":
            shape = (self.attn_layers, 2, self.page_size, self.kv_heads, self.head_dim)
            return _fields([("kv", shape, jnp.dtype(self.kv_dtype)), *self._draft_fields(kind)])
        if kind in ("state", "snapshot"):
            return _fields(
                [
                    (
                        "recurrent",
                        (lg, self.v_heads, self.key_dim, self.value_dim),
                        jnp.dtype(self.state_dtype),
                    ),
                    ("conv", (lg, self.conv_kernel - 1, self.conv_dim), jnp.dtype(self.conv_dtype)),
                    *self._draft_fields(kind),
                ]
            )
        if kind == "stash":
            return _fields(
                [
                    ("u", (lg, n, self.v_heads, self.value_dim), jnp.dtype(self.state_dtype)),
                    ("k", (lg, n, self.k_heads, self.key_dim), jnp.dtype(self.kv_dtype)),
                    ("g", (lg, n, self.v_heads), jnp.dtype(self.state_dtype)),
                    ("x", (lg, n, self.conv_dim), jnp.dtype(self.conv_dtype)),
                    (
                        "dk",
                        (self.attn_layers, n, self.kv_heads, self.head_dim),
                        jnp.dtype(self.kv_dtype),
                    ),
                    (
                        "dv",
                        (self.attn_layers, n, self.kv_heads, self.head_dim),
                        jnp.dtype(self.kv_dtype),
                    ),
                ]
            )
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def unit_words(self, kind: str) -> int:
        last = self.fields(kind)[-1]
        return last.word_offset + last.words

    def unit_bytes(self, kind: str) -> int:
        """Bytes one unit of ``kind`` occupies at its natural size (fields word-aligned)."""
        return self.unit_words(kind) * WORD_BYTES

    @property
    def kv_page_bytes(self) -> int:
        return self.unit_bytes("kv")

    @property
    def state_slot_bytes(self) -> int:
        return self.unit_bytes("state")

    @property
    def stash_bytes(self) -> int:
        return self.unit_bytes("stash")


def _text_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(config, str | os.PathLike):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping or a path to config.json, got {type(config)}")
    return config.get("text_config", config)


def layer_types(config: Mapping[str, Any] | str | os.PathLike) -> list[str]:
    """``"full_attention"`` / ``"linear_attention"`` per layer, from ``layer_types`` or
    ``full_attention_interval`` (layer ``i`` is full attention iff ``(i + 1) % interval == 0``)."""
    cfg = _text_config(config)
    if "layer_types" in cfg:
        types = list(cfg["layer_types"])
    elif "full_attention_interval" in cfg:
        n, every = int(cfg["num_hidden_layers"]), int(cfg["full_attention_interval"])
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    else:
        raise ValueError("config needs 'layer_types' or 'full_attention_interval'")
    unknown = set(types) - {"full_attention", "linear_attention"}
    if unknown:
        raise ValueError(f"config layer_types has unknown entries {sorted(unknown)}")
    return types


def layout_for(
    config: Mapping[str, Any] | str | os.PathLike,
    page_size: int = 16,
    *,
    num_layers: int | None = None,
    spec_nodes: int = 16,
    kv_dtype: str = "bfloat16",
) -> HybridLayout:
    """Build the layout of an HF-style hybrid config (Qwen3-Next, Qwen3.5; ``text_config`` ok).

    Args:
      config: the config dict, a ``config.json`` path, or a model directory.
      page_size: tokens per KV page.
      num_layers: keep only the first ``num_layers`` layers of the pattern. Benchmarks use this
        to scale a big model down (e.g. 4 = one GDN/GDN/GDN/attention period) while keeping
        its KV-to-state byte ratio; ``None`` keeps every layer.
      spec_nodes: draft-tree nodes per ``stash`` unit.
      kv_dtype: KV cache dtype (the conv state is bf16 and the recurrent state f32 regardless).
    """
    cfg = _text_config(config)
    types = layer_types(cfg)
    if num_layers is not None:
        if not 1 <= num_layers <= len(types):
            raise ValueError(f"num_layers must be in [1, {len(types)}], got {num_layers}")
        types = types[:num_layers]
    try:
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        return HybridLayout(
            page_size=page_size,
            attn_layers=types.count("full_attention"),
            kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=head_dim,
            gdn_layers=types.count("linear_attention"),
            k_heads=int(cfg["linear_num_key_heads"]),
            v_heads=int(cfg["linear_num_value_heads"]),
            key_dim=int(cfg["linear_key_head_dim"]),
            value_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            spec_nodes=spec_nodes,
            kv_dtype=kv_dtype,
        )
    except KeyError as e:
        raise ValueError(f"config is missing key {e.args[0]!r}") from None
