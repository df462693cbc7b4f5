"""Stateful property tests of the manager's invariants (docs/design.md), every policy.

After every step: no two live handles overlap; every byte written reads back bit for bit,
whatever migrations and compactions happened; free + used == arena; the host and device
tables agree. A failed allocation and every rejected call leave the manager unchanged; the
joint dry run ``fits_all`` changes nothing and predicts the allocations exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from serving.memory import (
    AllocationTooLargeError,
    DoubleFreeError,
    HandleKindError,
    OutOfMemoryError,
    UnknownHandleError,
    UnknownKindError,
    UnknownRequestError,
)
from tests.serving.memory.memory_helpers import (
    TINY,
    TINY_DRAFT,
    field_words,
    random_field,
    tiny_manager,
)

REQUESTS = st.sampled_from(["a", "b", "c", "d", 7])
KINDS = st.sampled_from(["kv", "kv", "state", "snapshot", "stash"])


def snapshot(mm) -> tuple:
    """Everything a rejected call must leave unchanged."""
    stats = mm.stats()
    return (
        sorted(mm.live(), key=repr),
        repr(stats),
        mm._table.tobytes(),
        [sorted(u) for u in mm.unowned],
    )


class ManagerMachine(RuleBasedStateMachine):
    policy = "avmp"
    policy_args: dict = {}
    layout = TINY

    def __init__(self):
        super().__init__()
        self.mm = tiny_manager(self.policy, segments=4, layout=self.layout, **self.policy_args)
        self.rng = np.random.default_rng(0)
        self.model: dict[int, tuple[str, object, dict[str, np.ndarray]]] = {}
        self.freed_requests: set = set()

    def _fill(self, kind, h):
        values = {f.name: random_field(f, self.rng) for f in self.mm.fields(kind)}
        for name, value in values.items():
            self.mm.write(kind, h, value, field=name)
        self.model[h] = (kind, self.model.get(h, (None, None))[1], values)

    @rule(rid=REQUESTS, kind=KINDS, n=st.integers(1, 5))
    def alloc(self, rid, kind, n):
        before = snapshot(self.mm)
        fits = self.mm.fits(kind, n)
        assert snapshot(self.mm) == before
        try:
            handles = self.mm.alloc(rid, kind, n)
        except (OutOfMemoryError, AllocationTooLargeError):
            assert not fits
            assert snapshot(self.mm) == before
            return
        assert fits
        assert len(handles) == len(set(handles)) == n
        for h in handles:
            assert h not in self.model
            self.model[h] = (kind, rid, {})
            self._fill(kind, h)
        self.freed_requests.discard(rid)

    @rule(rid=REQUESTS, kind=KINDS, n=st.integers(1, 5))
    def alloc_more(self, rid, kind, n):
        self.alloc(rid, kind, n)

    @rule(needs=st.lists(st.tuples(KINDS, st.integers(0, 6)), min_size=1, max_size=3))
    def fits_all_is_exact(self, needs):
        """The joint dry run changes nothing and answers what the allocations then do."""
        before = snapshot(self.mm)
        answer = self.mm.fits_all(needs)
        assert snapshot(self.mm) == before
        done = True
        for kind, n in needs:
            if n:
                try:
                    self.mm.alloc("probe", kind, n)
                except (OutOfMemoryError, AllocationTooLargeError):
                    done = False
                    break
        assert answer == done
        if self.mm.handles("probe"):
            self.mm.free("probe")  # the units moved by migrations keep their contents

    @rule(rid=REQUESTS)
    def free_request(self, rid):
        mine = [h for h, (_, r, _) in self.model.items() if r == rid]
        if not mine:
            before = snapshot(self.mm)
            err = DoubleFreeError if rid in self.freed_requests else UnknownRequestError
            with pytest.raises(err, match="request_id"):
                self.mm.free(rid)
            assert snapshot(self.mm) == before
            return
        self.mm.free(rid)
        for h in mine:
            del self.model[h]
        self.freed_requests.add(rid)

    @rule(rid=REQUESTS, kind=KINDS, data=st.data())
    def free_some(self, rid, kind, data):
        mine = [h for h, (k, r, _) in self.model.items() if r == rid and k == kind]
        if not mine:
            return
        some = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        self.mm.free(rid, kind, some)
        for h in some:
            del self.model[h]
        if not any(r == rid for _, r, _ in self.model.values()):
            self.freed_requests.add(rid)
        before = snapshot(self.mm)
        if self.mm.handles(rid):
            with pytest.raises(DoubleFreeError, match="handle"):
                self.mm.free(rid, kind, some[:1])
        else:
            with pytest.raises(DoubleFreeError, match="request_id"):
                self.mm.free(rid)
        assert snapshot(self.mm) == before

    @rule(data=st.data())
    def rewrite(self, data):
        if self.model:
            h = data.draw(st.sampled_from(sorted(self.model)))
            self._fill(self.model[h][0], h)

    @rule(data=st.data())
    def bad_calls_change_nothing(self, data):
        before = snapshot(self.mm)
        live = sorted(self.model)
        dead = next(h for h in range(10_000) if h not in self.model)
        with pytest.raises(UnknownHandleError, match="handle"):
            self.mm.read("kv", dead)
        with pytest.raises(UnknownKindError, match="kind"):
            self.mm.alloc("z", "weights")
        with pytest.raises(ValueError, match="n must"):
            self.mm.alloc("z", "kv", 0)
        with pytest.raises(AllocationTooLargeError, match="n="):
            self.mm.alloc("z", "state", self.mm.capacity("state") + 1)
        if live:
            h = data.draw(st.sampled_from(live))
            kind, rid, _ = self.model[h]
            other = "kv" if kind != "kv" else "state"
            with pytest.raises(HandleKindError, match="kind"):
                self.mm.read(other, h)
            with pytest.raises(ValueError, match="value must have shape"):
                self.mm.write(kind, h, np.zeros((1,), np.float32))
            with pytest.raises(ValueError, match="field"):
                self.mm.read(kind, h, field="nope")
            with pytest.raises(UnknownHandleError, match="handle"):
                self.mm.free(rid, None, [h, 10**9])
        assert snapshot(self.mm) == before

    @invariant()
    def no_overlap_and_accounting(self):
        mm = self.mm
        seg_words = mm.arena.segment_words
        spans = sorted((seg, word, word + words) for _, _, _, seg, word, words in mm.live())
        for (s0, _, e0), (s1, b1, _) in zip(spans, spans[1:], strict=False):
            assert s0 != s1 or e0 <= b1, "live handles overlap"
        assert all(e <= seg_words for _, _, e in spans)
        st_ = mm.stats()
        assert st_["free_bytes"] + st_["used_bytes"] == st_["arena_bytes"]
        counts = {
            k: sum(1 for v in self.model.values() if v[0] == k)
            for k in ("kv", "state", "snapshot", "stash")
        }
        assert (
            st_["kv_pages"],
            st_["state_slots"],
            st_["snapshot_slots"],
            st_["stash_units"],
        ) == tuple(counts.values())
        assert {h for h, *_ in mm.live()} == set(self.model)

    @invariant()
    def contents_survive(self):
        for h, (kind, _, values) in self.model.items():
            raw = np.asarray(self.mm.read_raw(kind, h))
            for f in self.mm.fields(kind):
                want = field_words([f], values)[f.name]
                got = raw[f.word_offset : f.word_offset + f.words]
                np.testing.assert_array_equal(got, want, err_msg=f"handle {h} field {f.name}")

    @invariant()
    def device_table_matches(self):
        table = np.asarray(self.mm.device_table())
        for h, _, _, seg, word, _ in self.mm.live():
            assert tuple(table[h]) == (seg, word)


SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(policy, layout=TINY, **args):
    attrs = {"policy": policy, "policy_args": args, "layout": layout}
    cls = type(f"{policy}Machine", (ManagerMachine,), attrs)
    return SETTINGS(cls).TestCase


TestAVMP = _machine("avmp")
TestStaticDual = _machine("static_dual", ratio=1.0)
TestMultiEnded = _machine("multi_ended")
TestUnifiedPadded = _machine("unified_padded")
# A draft model's fields in KV pages and state slots: four pools (snapshots get their own).
TestAVMPDraft = _machine("avmp", layout=TINY_DRAFT)
TestStaticDualDraft = _machine("static_dual", layout=TINY_DRAFT, ratio=1.0)
TestMultiEndedDraft = _machine("multi_ended", layout=TINY_DRAFT)


def test_draft_layout_has_four_pools():
    mm = tiny_manager("avmp", layout=TINY_DRAFT)
    assert [p.name for p in mm.pools] == ["kv", "state", "snapshot", "stash"]
    assert mm._pool_for("snapshot").unit_words < mm._pool_for("state").unit_words
    assert [p.name for p in tiny_manager("avmp").pools] == ["kv", "state", "stash"]
