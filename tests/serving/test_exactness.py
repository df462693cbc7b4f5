"""Greedy speculative decoding equals plain greedy decoding, token for token, for every request
of a batch: every drafter, static and dynamic trees, both verify methods, through continuous
batching (more requests than batch rows) and preemption (a memory budget too small for all)."""

from __future__ import annotations

import numpy as np
import pytest

from serving import LLM, SamplingParams, SpecConfig
from serving.memory import OutOfMemoryError
from tests.serving.conftest import ENGINE, VOCAB, prompts

PROMPTS = prompts(6)
PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in LLM(target, **ENGINE).generate(PROMPTS, PARAMS)]


SPECS = {
    "ngram-422-wy": dict(method="ngram", tree=(4, 2, 2)),
    "ngram-chain-snapshot": dict(method="ngram", tree=(1, 1, 1, 1), verify="snapshot"),
    "ngram-budget16-wy": dict(method="ngram", budget=16, depth=3),
    "draft-22-wy": dict(method="draft_model", tree=(2, 2)),
    "draft-budget12-snapshot": dict(method="draft_model", budget=12, depth=3, verify="snapshot"),
    "mtp-32-wy": dict(method="mtp", tree=(3, 2)),
    "mtp-budget12-wy": dict(method="mtp", budget=12, depth=3, branch=3),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_speculation_equals_plain(name, target, draft, plain):
    kw = dict(SPECS[name])
    if kw["method"] == "draft_model":
        kw["draft_model"] = draft
    outs = LLM(target, speculative=SpecConfig(**kw), **ENGINE).generate(PROMPTS, PARAMS)
    for out, ref in zip(outs, plain, strict=True):
        assert out.token_ids == ref, (name, out.index)
        assert len(out.token_ids) == PARAMS.max_tokens
        # the first token comes from prefill; each verify step emits its acceptance length
        # (the last one possibly cut by max_tokens)
        assert sum(out.metrics["acceptance_lengths"]) >= PARAMS.max_tokens - 1


def test_wy_and_snapshot_accept_the_same(target, plain):
    runs = {}
    for verify in ("wy", "snapshot"):
        spec = SpecConfig(method="ngram", tree=(4, 2, 2), verify=verify)
        outs = LLM(target, speculative=spec, **ENGINE).generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == plain
        runs[verify] = [o.metrics["acceptance_lengths"] for o in outs]
    assert runs["wy"] == runs["snapshot"]
    assert max(max(a) for a in runs["wy"]) > 1  # the n-gram drafter did get tokens accepted


@pytest.mark.parametrize("spec", [None, dict(method="ngram", tree=(2, 1), verify="snapshot")])
def test_preemption_loses_and_duplicates_nothing(spec, target, plain):
    speculative = SpecConfig(**spec) if spec else None
    layout = LLM(target, speculative=speculative, **ENGINE).layout
    n = speculative.num_nodes if speculative else 0
    # states and snapshots for all four rows, KV pages for 2 to 2.5 requests of 64 tokens
    # (8 pages each), in segments of one state slot: four rows must preempt
    seg = max(layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    fixed = 4 * (1 + n) * seg
    kv = int(2.5 * 8 * layout.unit_bytes("kv")) // seg * seg
    llm = LLM(
        target, memory_budget=fixed + kv, segment_bytes=seg, speculative=speculative, **ENGINE
    )
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert llm.scheduler.preemptions > 0
    assert sum(o.metrics["preemptions"] for o in outs) == llm.scheduler.preemptions
    assert llm.manager.stats()["requests"] == 0  # everything freed


def test_request_too_large_for_the_budget_raises(target):
    layout = LLM(target, **ENGINE).layout
    seg = max(layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    llm = LLM(target, memory_budget=2 * seg, segment_bytes=seg, **ENGINE)  # 1 state, 1 KV
    with pytest.raises(OutOfMemoryError, match="memory_budget"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=90 - len(PROMPTS[0])))


def test_stop_tokens_and_max_tokens(target, plain):
    stop = plain[0][5]
    outs = LLM(target, **ENGINE).generate(
        PROMPTS[:1], SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    )
    first = plain[0].index(stop)
    assert outs[0].token_ids == plain[0][: first + 1]


def test_prompt_admission_keeps_long_prefills_from_preempting(target):
    """Long prompts crowding a small arena: admission that reserves only the first chunk
    lets several long prompts start and preempts them part way through their prefill;
    admission that reserves the whole prompt runs them without a preemption. The tokens are
    the same either way (and those of an unconstrained engine)."""
    rng = np.random.default_rng(3)
    lens = (6, 70, 8, 64, 5, 72, 7, 60)
    batch = [rng.integers(0, VOCAB, n).tolist() for n in lens]
    params = SamplingParams(max_tokens=10)
    want = [o.token_ids for o in LLM(target, **ENGINE).generate(batch, params)]
    layout = LLM(target, **ENGINE).layout
    seg = max(layout.unit_bytes(k) for k in ("kv", "state"))
    # four segments, each one state slot or 8 KV pages (64 tokens)
    budget = 4 * seg
    runs = {}
    for admission in ("chunk", "prompt"):
        llm = LLM(target, memory_budget=budget, segment_bytes=seg, admission=admission, **ENGINE)
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == want, admission
        assert llm.manager.stats()["requests"] == 0
        runs[admission] = llm.scheduler.preemptions
    assert runs["chunk"] > 0 and runs["prompt"] == 0, runs
    with pytest.raises(ValueError, match="admission must be one of"):
        LLM(target, admission="eager", **ENGINE)
