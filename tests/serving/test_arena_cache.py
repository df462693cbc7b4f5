"""The engine's cache lives only in the memory manager's arena (``LLM(cache="arena")``, the
default): greedy outputs equal the pooled path and a plain full-forward reference, the arena
holds bit for bit what the pools hold, the device holds nothing else between steps, and
migrations / compactions between steps (handles moved, table updated) change nothing."""

from __future__ import annotations

import gc
import itertools
import weakref

import jax
import numpy as np
import pytest
from flax import nnx

from serving import LLM, SamplingParams, SpecConfig
from serving.memory import OutOfMemoryError
from serving.scheduler import Request
from tests.serving.conftest import ENGINE, prompts

PROMPTS = prompts(6)
PARAMS = SamplingParams(max_tokens=24)
_ids = itertools.count()


@pytest.fixture(scope="module")
def reference(target):
    """Greedy tokens by the full forward pass over the whole sequence (no cache at all)."""
    fwd = nnx.jit(lambda m, ids: m(ids))
    out = []
    for p in PROMPTS:
        seq = list(p)
        for _ in range(PARAMS.max_tokens):
            ids = np.zeros((1, 64), np.int32)  # causal: the padding after does not matter
            ids[0, : len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(fwd(target, ids))[0, len(seq) - 1])))
        out.append(seq[len(p) :])
    return out


def drive(llm: LLM, prompt_ids, params, between=None, requests=None) -> list[list[int]]:
    """``llm.generate`` one engine step at a time, calling ``between(llm)`` after each; the
    requests are appended to ``requests`` when given."""
    reqs = [
        Request(index=i, rid=("arena-test", next(_ids)), prompt=list(p), params=params, arrival=0.0)
        for i, p in enumerate(prompt_ids)
    ]
    if requests is not None:
        requests += reqs
    for r in reqs:
        llm.scheduler.add(r)
    while llm.scheduler.waiting or llm.scheduler.running:
        llm.engine.step()
        if between is not None:
            between(llm)
    return [r.output for r in reqs]


def test_arena_is_the_default_and_validates(target):
    llm = LLM(target, **ENGINE)
    assert llm.runner.kind == "arena"
    assert llm.runner.manager is llm.manager
    with pytest.raises(ValueError, match="cache"):
        LLM(target, cache="hbm", **ENGINE)


def test_arena_equals_pools_and_full_forward(target, reference):
    arena = [o.token_ids for o in LLM(target, **ENGINE).generate(PROMPTS, PARAMS)]
    pools = [o.token_ids for o in LLM(target, cache="pools", **ENGINE).generate(PROMPTS, PARAMS)]
    assert arena == reference
    assert pools == reference


@pytest.mark.parametrize("policy", ["unified_padded", "static_dual", "multi_ended"])
def test_every_policy_gives_the_same_tokens(policy, target, reference):
    llm = LLM(target, memory_policy=policy, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference


def test_arena_holds_what_the_pools_hold(target):
    """Step for step, the manager's ``read`` of each request's state and KV units equals the
    pooled engine's per-layer arrays at its slot / pages, bit for bit."""
    arena = LLM(target, **ENGINE)
    pools = LLM(target, cache="pools", **ENGINE)
    params = SamplingParams(max_tokens=10)
    checked = []

    runs = {}
    for name, llm in (("arena", arena), ("pools", pools)):
        reqs = [
            Request(index=i, rid=(name, next(_ids)), prompt=p, params=params, arrival=0.0)
            for i, p in enumerate(PROMPTS[:3])
        ]
        for r in reqs:
            llm.scheduler.add(r)
        runs[name] = reqs
    mm = arena.manager
    page = arena.scheduler.page_size
    while arena.scheduler.running or arena.scheduler.waiting:
        arena.engine.step()
        pools.engine.step()
        pool = pools.runner.pool  # donated and replaced by every step
        for ra, rp in zip(runs["arena"], runs["pools"], strict=True):
            if ra.finished or ra.state_handle is None or ra.computed == 0:
                continue
            assert ra.computed == rp.computed
            h = ra.state_handle
            np.testing.assert_array_equal(mm.read("state", h, "recurrent"), pool.ssm[:, rp.slot])
            np.testing.assert_array_equal(mm.read("state", h, "conv"), pool.conv[:, rp.slot])
            for j, (hk, pg) in enumerate(zip(ra.kv_handles, rp.pages, strict=True)):
                n = min(page, ra.computed - j * page)  # tokens written in this page
                if n <= 0:
                    continue
                kv = np.asarray(mm.read("kv", hk))  # [La, 2, S, Hkv, D]
                np.testing.assert_array_equal(kv[:, 0, :n], pool.k_pages[:, pg, :n])
                np.testing.assert_array_equal(kv[:, 1, :n], pool.v_pages[:, pg, :n])
            checked.append(ra.computed)
    assert [r.output for r in runs["arena"]] == [r.output for r in runs["pools"]]
    assert len(checked) > 10


def _engine_arrays(baseline: dict[int, weakref.ref], llm) -> list[jax.Array]:
    """The live device arrays made since ``baseline``, less the engine's weights (its fused
    projections are its own arrays: gdn_jax.models.fuse_projections)."""
    gc.collect()
    runners = (llm.engine.runner, llm.engine.draft_runner)
    weights = {id(x) for r in runners if r is not None for x in jax.tree.leaves(nnx.state(r.model))}
    return [
        a
        for a in jax.live_arrays()
        if (id(a) not in baseline or baseline[id(a)]() is not a) and id(a) not in weights
    ]


@pytest.mark.parametrize("cache", ["arena", "pools"])
def test_no_second_copy_and_flat_device_memory(cache, target):
    """Between engine steps the device holds exactly the arena and the handle table (besides
    the weights and what existed before), step after step; the pooled path holds its pools
    on top (the duplicate this test exists to catch)."""
    gc.collect()
    baseline = {id(a): weakref.ref(a) for a in jax.live_arrays()}
    spec = SpecConfig(method="ngram", tree=(4, 2, 2))
    llm = LLM(target, speculative=spec, cache=cache, **ENGINE)
    arena = llm.manager.arena
    seen = []

    def measure(llm):
        arrays = _engine_arrays(baseline, llm)
        seen.append((len(arrays), sum(a.nbytes for a in arrays)))
        if cache == "arena":  # the runner's table is the manager's last upload
            assert {id(a) for a in arrays} <= {id(arena.buffer), id(llm.runner._table)}, [
                (a.shape, a.dtype) for a in arrays
            ]

    out = drive(llm, prompts(10, seed=5), SamplingParams(max_tokens=30), measure)
    assert len(seen) > 30 and all(len(o) == 30 for o in out)
    counts, nbytes = zip(*seen, strict=True)
    if cache == "arena":
        assert max(nbytes) == arena.nbytes + llm.runner._table.nbytes
        assert min(nbytes) >= arena.nbytes
        assert 0 < llm.runner.table_uploads <= 2 * len(seen)
    else:
        pool_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.runner.pool))
        assert min(nbytes) >= arena.nbytes + pool_bytes  # the cache twice
    assert max(counts) - min(counts) <= 1 and max(nbytes) - min(nbytes) <= 64 << 10


def _fill_and_free(mm) -> None:
    """Take every unit the arena can give as ``stash`` units of a dummy request (the manager
    takes free segments, then compacts the pool with segments to spare, moving live units of
    the running requests), then free them."""
    k = min(64, mm.capacity("stash"))
    while True:
        try:
            mm.alloc("dummy", "stash", k)
        except OutOfMemoryError:
            if k == 1:
                break
            k //= 2
    mm.free("dummy")


def compacting(moved: list[int]):
    """A ``drive`` callback: after each step a filler request takes every free KV unit, so the
    running requests' next pages land in fresh segments; every third step the filler is freed
    and the arena filled with stash units (:func:`_fill_and_free`), which compacts the KV pool.
    Appends to ``moved`` how many live units of running requests moved (0 on other steps)."""

    def perturb(llm):
        mm = llm.manager
        free = mm.stats()["pools"]["kv"]["free_units"]
        if free:
            mm.alloc("filler", "kv", free)
        if len(moved) % 3 == 2 and mm.handles("filler"):
            running = {r.rid for r in llm.scheduler.running}
            before = {h: (s, w) for h, _, rid, s, w, _ in mm.live() if rid in running}
            mm.free("filler")
            _fill_and_free(mm)
            after = {h: (s, w) for h, _, rid, s, w, _ in mm.live() if rid in running}
            assert after.keys() == before.keys()
            moved.append(sum(before[h] != after[h] for h in before))
        else:
            moved.append(0)

    return perturb


@pytest.mark.parametrize("spec", [None, dict(method="ngram", tree=(4, 2, 2))])
def test_compaction_between_steps_keeps_outputs(spec, target, reference):
    """Between steps: a filler request takes every free KV unit, so the running requests'
    next pages land in fresh segments; every third step the filler is freed (KV segments
    holding a page or two each) and the arena is filled with stash units, which compacts the
    KV pool: live pages move, the table changes, and the next step reads through it."""
    speculative = SpecConfig(**spec) if spec else None
    layout = LLM(target, speculative=speculative, **ENGINE).layout
    unit = max(layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    llm = LLM(
        target, memory_budget=48 * unit, segment_bytes=unit, speculative=speculative, **ENGINE
    )
    mm = llm.manager
    moved = []
    out = drive(llm, PROMPTS, PARAMS, compacting(moved))
    assert out == reference
    stats = mm.stats()
    assert stats["compactions"] > 0 and stats["migrations"] > 0, (
        stats["compactions"],
        stats["migrations"],
    )
    assert sum(moved) > 0, moved  # live units of running requests moved between steps
