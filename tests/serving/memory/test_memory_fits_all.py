"""``fits_all`` against the allocations themselves, over random call sequences.

Random traffic brings a small arena into an arbitrary state; then a joint need is asked of
``fits_all`` and performed with ``alloc``, in order. The answer must be exactly what the
allocations do (including needs that acquire segments from other pools, that compact, and that
fail part-way), and asking must change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serving.memory import AllocationTooLargeError, OutOfMemoryError
from tests.serving.memory.memory_helpers import TINY, TINY_DRAFT, tiny_manager

ARGS = {"static_dual": {"ratio": 1.0}}
POLICIES = ["avmp", "static_dual", "multi_ended", "unified_padded"]
KINDS = ["kv", "state", "snapshot", "stash"]
_FAILED = (OutOfMemoryError, AllocationTooLargeError)


def _state(mm) -> tuple:
    return (
        sorted(mm.live(), key=repr),
        repr(mm.stats()),
        mm._table.tobytes(),
        [list(u) for u in mm.unowned],
        list(mm.seg_owner),
        list(mm.seg_live),
        list(mm.seg_rank),
    )


def _traffic(mm, ops) -> None:
    """``("alloc", rid, kind, n)`` or ``("free", rid, part)``: free a prefix of ``part`` of the
    request's handles (all of them when ``part`` is 1.0)."""
    for op in ops:
        if op[0] == "alloc":
            _, rid, kind, n = op
            try:
                mm.alloc(rid, kind, n)
            except _FAILED:
                pass
        elif mm.handles(op[1]):
            held = mm.handles(op[1])
            mm.free(op[1], handles=held[: max(1, round(op[2] * len(held)))])


def check_fits_all(mm, needs) -> set[str]:
    """Assert that ``fits_all(needs)`` changes nothing and answers what allocating ``needs``
    in order then does; free what that allocated. Returns what the allocations did: some of
    ``fits``, ``fails``, ``migrates`` (took segments from other pools), ``compacts`` (moved
    live units)."""
    before = _state(mm)
    answer = mm.fits_all(needs)
    assert _state(mm) == before
    stats = mm.stats()
    done = True
    for kind, n in needs:
        if n:
            try:
                mm.alloc("probe", kind, n)
            except _FAILED:
                done = False
                break
    assert answer == done, needs
    after = mm.stats()
    seen = {"fits" if done else "fails"}
    if after["migrations"] > stats["migrations"]:
        seen.add("migrates")
    if after["compactions"] > stats["compactions"]:
        seen.add("compacts")
    if mm.handles("probe"):
        mm.free("probe")
    return seen


_REQUESTS = st.integers(0, 5)
_ALLOC = st.tuples(st.just("alloc"), _REQUESTS, st.sampled_from(KINDS), st.integers(1, 10))
_FREE = st.tuples(st.just("free"), _REQUESTS, st.sampled_from([0.3, 0.5, 0.5, 1.0]))
_NEEDS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 8)), min_size=1, max_size=3)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    policy=st.sampled_from(POLICIES),
    draft=st.booleans(),
    segments=st.integers(3, 8),
    rounds=st.lists(
        st.tuples(st.lists(st.one_of(_ALLOC, _ALLOC, _FREE), max_size=10), _NEEDS),
        min_size=1,
        max_size=10,
    ),
)
def test_fits_all_agrees_with_the_allocations(policy, draft, segments, rounds):
    if draft and policy == "unified_padded":
        draft = False  # one pool either way
    layout = TINY_DRAFT if draft else TINY
    mm = tiny_manager(policy, segments=segments, layout=layout, **ARGS.get(policy, {}))
    for ops, needs in rounds:
        _traffic(mm, ops)
        for what in sorted(check_fits_all(mm, needs)):
            event(f"fits_all: {what}")


@pytest.mark.parametrize("policy", ["avmp", "multi_ended"])
def test_random_needs_cover_migration_compaction_and_failure(policy):
    """The check above over seeded random rounds meets every case: needs that fit from free
    units, that take segments from other pools, that compact, and that fail."""
    rng = np.random.default_rng(11)
    mm = tiny_manager(policy, segments=6)
    seen: set[str] = set()
    for _ in range(150):
        ops = []
        for _ in range(int(rng.integers(0, 6))):
            rid = int(rng.integers(0, 6))
            if rng.random() < 0.6:
                ops.append(("alloc", rid, KINDS[rng.integers(0, 4)], int(rng.integers(1, 14))))
            else:
                ops.append(("free", rid, float(rng.choice([0.3, 0.5, 1.0]))))
        _traffic(mm, ops)
        needs = [
            (KINDS[rng.integers(0, 4)], int(rng.integers(0, 16)))
            for _ in range(int(rng.integers(1, 4)))
        ]
        seen |= check_fits_all(mm, needs)
    assert seen == {"fits", "fails", "migrates", "compacts"}
