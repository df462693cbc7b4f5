"""A draft model's cache lives in the target's arena (``LLM(cache="arena")`` with the
``draft_model`` drafter): its K/V and states are ``draft_*`` fields of the target's own KV pages
and state slots, addressed by the same handles. The drafts it makes (so the acceptance lengths)
equal those of its dense pools (``cache="pools"``), through compactions between steps, and the
device holds nothing but the arena and the handle table between steps."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.models import init_random
from gdn_jax.models.config import LINEAR
from serving import LLM, SamplingParams, SpecConfig
from serving.arena_spec import ArenaSpec
from serving.memory import HybridLayout, layout_for
from tests.serving.conftest import ENGINE, prompts, sharpened, tiny_config
from tests.serving.test_arena_cache import _engine_arrays, compacting, drive

PARAMS = SamplingParams(max_tokens=24)
SPECS = {
    "wy": dict(method="draft_model", tree=(2, 2)),
    "snapshot": dict(method="draft_model", budget=8, depth=3, verify="snapshot"),
}


def _spec(name, draft):
    return SpecConfig(**SPECS[name], draft_model=draft)


@pytest.fixture(scope="module")
def pools_runs(target, draft):
    """Tokens and acceptance lengths with the draft in its own dense pools (the reference)."""
    out = {}
    for name in SPECS:
        llm = LLM(target, speculative=_spec(name, draft), cache="pools", **ENGINE)
        assert llm.engine.draft_runner.kind == "pools"
        res = llm.generate(prompts(6), PARAMS)
        out[name] = ([o.token_ids for o in res], [o.metrics["acceptance_lengths"] for o in res])
    return out


def test_draft_fields_share_the_target_units(target, draft):
    llm = LLM(target, speculative=_spec("wy", draft), **ENGINE)
    lay = llm.manager.layout
    assert lay.draft is not None
    plain = dataclasses.replace(lay, draft=None)
    names = {k: [f.name for f in lay.fields(k)] for k in ("kv", "state", "snapshot", "stash")}
    assert names["kv"] == ["kv", "draft_kv"]
    assert names["state"] == ["recurrent", "conv", "draft_recurrent", "draft_conv"]
    # no draft scratch: snapshot and stash units as without a draft; snapshots get their own
    # pool (a state slot's room would waste the draft part per node)
    for kind in ("snapshot", "stash"):
        assert lay.fields(kind) == plain.fields(kind)
    pools = {k: llm.manager._pool_for(k).name for k in ("kv", "state", "snapshot", "stash")}
    assert pools == {"kv": "kv", "state": "state", "snapshot": "snapshot", "stash": "stash"}
    # each unit grows by exactly the draft's own unit, at the target's page size and dtypes
    alone = dataclasses.replace(
        lay.draft, page_size=lay.page_size, kv_dtype=lay.kv_dtype, conv_dtype=lay.conv_dtype
    )
    for kind in ("kv", "state"):
        assert lay.unit_words(kind) == plain.unit_words(kind) + alone.unit_words(kind)

    # the two runners address disjoint words of the same units
    t, d = llm.runner.spec, llm.engine.draft_runner.spec
    assert llm.engine.draft_runner.kind == "arena" and llm.engine.draft_runner.draft
    assert d.kv_offset >= t.kv_offset + t.attn_layers * 2 * t.page_size * t.token_words
    assert d.state_offset >= t.conv_offset + t.gdn_layers * t.conv_words
    assert d.conv_offset >= d.state_offset + d.gdn_layers * d.state_words
    assert d.stash == () and t.stash
    assert (d.gdn_layers, d.attn_layers) == (
        len(draft.config.gdn_layers),
        len(draft.config.attn_layers),
    )


def test_layout_validation():
    cfg = tiny_config().to_hf_dict()
    lay = layout_for(cfg, 8)
    with pytest.raises(ValueError, match="draft"):
        ArenaSpec.from_layout(lay, jnp.float32, draft=True)
    with pytest.raises(ValueError, match="HybridLayout.draft"):
        HybridLayout(**{**dataclasses.asdict(lay), "draft": dataclasses.replace(lay, draft=lay)})
    with pytest.raises(ValueError, match="HybridLayout.draft"):
        dataclasses.replace(lay, draft="not a layout")


@pytest.mark.parametrize("name", list(SPECS))
def test_arena_draft_makes_the_pools_drafts(name, target, draft, pools_runs):
    """Same tokens and the same acceptance lengths as the draft's dense pools: the drafts
    (which decide the acceptance) come out the same, also when every step is followed by a
    compaction that moves the running requests' units (draft fields included)."""
    tokens, accepts = pools_runs[name]
    assert max(max(a) for a in accepts) > 1  # the draft did get tokens accepted
    llm = LLM(target, speculative=_spec(name, draft), **ENGINE)
    res = llm.generate(prompts(6), PARAMS)
    assert [o.token_ids for o in res] == tokens
    assert [o.metrics["acceptance_lengths"] for o in res] == accepts

    unit = max(llm.layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    llm = LLM(
        target,
        speculative=_spec(name, draft),
        memory_budget=48 * unit,
        segment_bytes=unit,
        **ENGINE,
    )
    moved, reqs = [], []
    out = drive(llm, prompts(6), PARAMS, compacting(moved), reqs)
    assert out == tokens
    assert [r.accept_lengths for r in reqs] == accepts
    assert llm.manager.stats()["compactions"] > 0
    assert sum(moved) > 0, moved  # live units of running requests moved between steps


def test_draft_cache_is_no_second_buffer(target, draft):
    """Between steps the device holds the arena and the handle table only: no draft pools."""
    gc.collect()
    baseline = {id(a): weakref.ref(a) for a in jax.live_arrays()}
    llm = LLM(target, speculative=_spec("wy", draft), **ENGINE)
    arena, runners = llm.manager.arena, (llm.runner, llm.engine.draft_runner)
    seen = []

    def measure(llm):
        arrays = _engine_arrays(baseline, llm)
        allowed = {id(arena.buffer)} | {id(r._table) for r in runners}
        assert {id(a) for a in arrays} <= allowed, [(a.shape, a.dtype) for a in arrays]
        seen.append(sum(a.nbytes for a in arrays))

    out = drive(llm, prompts(6, seed=3), SamplingParams(max_tokens=20), measure)
    assert len(seen) > 10 and all(len(o) == 20 for o in out)
    assert max(seen) <= arena.nbytes + 2 * llm.runner._table.nbytes
    assert not hasattr(llm.engine.draft_runner, "pool")
    assert np.all(np.asarray(seen) >= arena.nbytes)


def test_draft_without_attention_keeps_its_own_pools(target):
    """A GDN-only draft has no hybrid layout to share: it keeps dense pools (and still
    drafts for the arena-backed target)."""
    cfg = tiny_config(
        num_hidden_layers=2, layer_types=(LINEAR, LINEAR), mtp_num_hidden_layers=0, hidden_size=16
    )
    gdn_only = sharpened(init_random(cfg, jnp.float32, seed=3))
    spec = SpecConfig(method="draft_model", draft_model=gdn_only, tree=(2, 2))
    llm = LLM(target, speculative=spec, **ENGINE)
    assert llm.runner.kind == "arena" and llm.engine.draft_runner.kind == "pools"
    assert llm.manager.layout.draft is None
    plain = LLM(target, **ENGINE).generate(prompts(3), PARAMS)
    out = llm.generate(prompts(3), PARAMS)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_snapshot_memory_does_not_grow_with_the_draft(target, draft):
    """The snapshot baseline's speculative memory is the same with the draft in the arena as
    with its own pools: per-node snapshots carry no draft fields."""
    spec = _spec("snapshot", draft)
    arena = LLM(target, speculative=spec, **ENGINE)
    pools = LLM(target, speculative=spec, cache="pools", **ENGINE)
    assert arena.spec_bytes_per_request == pools.spec_bytes_per_request > 0
    assert arena.manager._pool_for("snapshot").unit_words == arena.layout.unit_words("snapshot")
    assert pools.manager._pool_for("snapshot").name == "state"  # no draft: shares the pool
