"""Tiny layouts and helpers shared by the memory-manager tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.memory import HybridLayout, MemoryManager

# kv page 128 B, state slot 672 B, stash 816 B: a 1632 B segment holds 12 pages, 2 slots or
# 2 stashes, so a 6-segment arena migrates and compacts within a few steps.
TINY = HybridLayout(
    page_size=4,
    attn_layers=1,
    kv_heads=1,
    head_dim=8,
    gdn_layers=3,
    k_heads=1,
    v_heads=2,
    key_dim=4,
    value_dim=4,
    spec_nodes=3,
)
TINY_SEGMENTS = 6
# With a draft model's fields in its KV pages and state slots (so snapshots get a fourth pool).
TINY_DRAFT = dataclasses.replace(
    TINY,
    draft=HybridLayout(
        page_size=4,
        attn_layers=1,
        kv_heads=1,
        head_dim=4,
        gdn_layers=1,
        k_heads=1,
        v_heads=1,
        key_dim=4,
        value_dim=4,
    ),
)


def tiny_manager(
    policy: str, segments: int = TINY_SEGMENTS, layout: HybridLayout = TINY, **kwargs
) -> MemoryManager:
    """A manager over ``layout`` (:data:`TINY`) with ``segments`` segments of two of its
    largest units."""
    probe = MemoryManager(layout, 1 << 23, policy, **kwargs)
    seg = 2 * max(p.unit_words for p in probe.pools) * 4
    return MemoryManager(layout, segments * seg, policy, segment_bytes=seg, **kwargs)


def random_field(field, rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns (NaNs and infs included) of a field's shape and dtype."""
    n = int(np.prod(field.shape))
    bits = rng.integers(
        0, 1 << (8 * field.dtype.itemsize), n, dtype=np.dtype(f"u{field.dtype.itemsize}")
    )
    return bits.view(field.dtype).reshape(field.shape)


def field_words(fields, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Expected uint32 words of each field (the trailing half word of odd bf16 counts zero)."""
    out = {}
    for f in fields:
        raw = values[f.name].reshape(-1).view(np.uint8)
        raw = np.concatenate([raw, np.zeros(f.words * 4 - raw.size, np.uint8)])
        out[f.name] = raw.view(np.uint32)
    return out
