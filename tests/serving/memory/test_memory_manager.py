"""Manager behaviour beyond the per-step invariants: long random runs, determinism, no device
copies of the arena, policy-specific sizing, the kernel-side view, argument errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serving.memory import (
    AllocationTooLargeError,
    HybridLayout,
    MemoryManager,
    OutOfMemoryError,
    view,
)
from tests.serving.memory.memory_helpers import TINY, field_words, random_field, tiny_manager

ARGS = {"static_dual": {"ratio": 1.0}}
POLICIES = ["avmp", "static_dual", "multi_ended", "unified_padded"]


def random_run(mm, steps, seed, *, fill=True, check_every=0):
    """Random alloc/free traffic; returns {handle: (kind, words per field)} of what is live."""
    rng = np.random.default_rng(seed)
    model: dict[int, tuple[str, dict]] = {}
    kinds = ["kv", "kv", "kv", "state", "snapshot", "stash"]
    for step in range(steps):
        rid = int(rng.integers(0, 8))
        if rng.random() < 0.6:
            kind = kinds[rng.integers(0, len(kinds))]
            try:
                hs = mm.alloc(rid, kind, int(rng.integers(1, 6)))
            except (OutOfMemoryError, AllocationTooLargeError):
                continue
            for h in hs:
                values = {}
                if fill:
                    values = {f.name: random_field(f, rng) for f in mm.fields(kind)}
                    for name, v in values.items():
                        mm.write(kind, h, v, field=name)
                model[h] = (kind, values)
        elif mm.handles(rid):
            for h in mm.handles(rid):
                del model[h]
            mm.free(rid)
        if check_every and step % check_every == 0:
            check_contents(mm, model)
    return model


def check_contents(mm, model):
    for h, (kind, values) in model.items():
        raw = np.asarray(mm.read_raw(kind, h))
        for f in mm.fields(kind):
            want = field_words([f], values)[f.name]
            np.testing.assert_array_equal(raw[f.word_offset: f.word_offset + f.words], want)


@pytest.mark.parametrize("policy", POLICIES)
def test_long_random_run_keeps_every_byte(policy):
    mm = tiny_manager(policy, segments=5, **ARGS.get(policy, {}))
    model = random_run(mm, 300, seed=1, check_every=25)
    check_contents(mm, model)
    st = mm.stats()
    assert st["free_bytes"] + st["used_bytes"] == st["arena_bytes"]
    if policy in ("avmp", "multi_ended"):
        assert st["migrations"] > 0 and st["compactions"] > 0 and st["migrated_bytes"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_same_calls_give_the_same_layout(policy):
    layouts = []
    for _ in range(2):
        mm = tiny_manager(policy, segments=5, **ARGS.get(policy, {}))
        random_run(mm, 300, seed=2, fill=False)
        layouts.append((sorted(mm.live(), key=repr), repr(mm.stats()), mm._table.tobytes()))
    assert layouts[0] == layouts[1]


def test_live_device_buffers_stay_flat_over_1000_steps():
    mm = tiny_manager("avmp", segments=5)
    random_run(mm, 200, seed=3, fill=False)  # warm up: compile every copy and table shape
    mm.device_table()

    def footprint():
        arrays = jax.live_arrays()
        return len(arrays), sum(a.nbytes for a in arrays)

    before, migrated = footprint(), mm.stats()["migrated_bytes"]
    rng = np.random.default_rng(4)
    seen = set()
    for step in range(1000):
        rid = int(rng.integers(0, 8))
        if rng.random() < 0.6:
            try:
                mm.alloc(rid, ["kv", "state", "stash"][step % 3], int(rng.integers(1, 5)))
            except (OutOfMemoryError, AllocationTooLargeError):
                pass
        elif mm.handles(rid):
            mm.free(rid)
        if step % 50 == 0:
            mm.device_table()
            seen.add(footprint())
    assert mm.stats()["migrated_bytes"] > migrated
    assert seen == {before}, f"live buffers changed: {before} -> {seen}"


def test_migration_only_when_allocation_fails():
    mm = tiny_manager("avmp", segments=6)
    mm.alloc("a", "kv", 11)
    mm.alloc("b", "state", 2)
    assert mm.stats()["migrations"] == 0 and mm.stats()["unowned_segments"] == 4


def test_handles_are_stable_across_compaction():
    mm = tiny_manager("avmp", segments=3)
    rng = np.random.default_rng(5)
    mm.alloc("a", "kv", 11)
    hs = mm.alloc("b", "kv", 5)
    mm.free("a")
    hs += mm.alloc("c", "kv", 1)  # segment 0 again: the KV pool now has 6 pages in 2 segments
    values = {h: random_field(mm.fields("kv")[0], rng) for h in hs}
    for h, v in values.items():
        mm.write("kv", h, v)
    before = {h: mm._table[h].tolist() for h in hs}
    mm.alloc("d", "state", 4)  # 2 segments: the unowned one, and one compacted out of KV
    st = mm.stats()
    assert st["compactions"] == 1 and st["migrations"] == 1 and st["migrated_bytes"] > 0
    assert any(mm._table[h].tolist() != before[h] for h in hs)
    for h in hs:
        np.testing.assert_array_equal(np.asarray(mm.read("kv", h)).view(np.uint16),
                                      values[h].view(np.uint16))


def test_unified_padded_reports_padding_and_bigger_pages():
    mm = MemoryManager(TINY, 1 << 23, "unified_padded")
    unit = mm.stats()["pools"]["unified"]["unit_bytes"]
    assert unit >= max(TINY.state_slot_bytes, TINY.stash_bytes)
    assert mm.tokens_per_page % TINY.page_size == 0 and mm.tokens_per_page > TINY.page_size
    mm.alloc("a", "state", 3)
    mm.alloc("a", "kv", 2)
    assert mm.stats()["padding_bytes"] == 3 * (unit - TINY.state_slot_bytes)


def test_static_dual_never_lends_across_sides():
    mm = tiny_manager("static_dual", segments=6, ratio=0.5)
    assert mm.capacity("kv") == 4 * mm.pools[0].units_per_segment
    with pytest.raises(OutOfMemoryError):
        for _ in range(100):
            mm.alloc("a", "state", 1)
    assert mm.stats()["state_slots"] == 2 * 2
    assert mm.stats()["migrations"] == 0


def test_multi_ended_keeps_kv_a_prefix():
    mm = tiny_manager("multi_ended", segments=6)
    random_run(mm, 200, seed=6, fill=False)
    kv = mm.pools[0].index
    owners = mm.seg_owner
    kv_segs = [s for s, o in enumerate(owners) if o == kv]
    assert kv_segs == list(range(len(kv_segs)))
    assert all(o not in (-1, kv) for o in owners[len(kv_segs) + len(mm.unowned[0]):])


def test_view_reads_through_the_device_table():
    mm = tiny_manager("avmp")
    rng = np.random.default_rng(7)
    h = mm.alloc("a", "state", 2)[1]
    f = mm.fields("state")[1]
    value = random_field(f, rng)
    mm.write("state", h, value, field="conv")
    got = jax.jit(lambda b, t, i: view(b, t, i, f))(mm.arena.buffer, mm.device_table(), h)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), value.view(np.uint16))


@pytest.mark.parametrize("kwargs, match", [
    ({"budget_bytes": 100}, "budget_bytes"),
    ({"budget_bytes": 0.5}, "memory_stats"),
    ({"budget_bytes": -1}, "budget_bytes"),
    ({"policy": "lru"}, "policy"),
    ({"policy": "avmp", "ratio": 2}, "avmp"),
    ({"policy": "static_dual", "ratio": -1}, "ratio"),
    ({"segment_bytes": 6}, "segment_bytes"),
])
def test_constructor_errors_name_the_argument(kwargs, match):
    kwargs = {"budget_bytes": 1 << 23, **kwargs}
    with pytest.raises(ValueError, match=match):
        MemoryManager(TINY, **kwargs)


def test_default_segment_packs_every_pool():
    # kv page 8 KiB, state slot 52.5 KiB, stash 27.4 KiB: a segment of one state slot would
    # hold one stash and leave 48% of it unused; the default must pick a size that packs all.
    lay = HybridLayout(page_size=32, attn_layers=1, kv_heads=1, head_dim=64, gdn_layers=3,
                       k_heads=2, v_heads=4, key_dim=32, value_dim=32, spec_nodes=8)
    budget = 12 * lay.state_slot_bytes
    mm = MemoryManager(lay, budget, "avmp")
    seg = mm.arena.segment_words
    for pool in mm.pools:
        assert pool.units_per_segment * pool.unit_words >= 0.9 * seg, pool.name
    assert mm.arena.nbytes <= budget
    assert MemoryManager(lay, budget, "avmp").arena.segment_words == seg  # deterministic
