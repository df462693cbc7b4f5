"""Async scheduling (``LLM(async_scheduling=True)``, :meth:`serving.engine.Engine._step_async`):
plain decode step t+1 is dispatched, its tokens fed from step t on the device, before step t's
tokens are fetched; requests join and leave between any two steps; greedy or sampled, through
stop tokens, per-request limits and preemption, the tokens are those of one step at a time."""

from __future__ import annotations

import pytest

from serving import LLM, SamplingParams
from tests.serving.conftest import ENGINE, prompts

# more prompts than rows, so requests join while others decode
PROMPTS = prompts(7, seed=3)


@pytest.fixture(scope="module")
def sync(target):
    return LLM(target, **ENGINE)


@pytest.fixture(scope="module")
def overlapped(target):
    return LLM(target, async_scheduling=True, **ENGINE)


def _params(ref):
    stop = ref[0][3]  # request 0 stops at its 4th token (and any other that emits it)
    return [
        SamplingParams(
            max_tokens=[12, 5, 9, 1, 12, 7, 10][i], stop_token_ids=[stop] if i < 2 else []
        )
        for i in range(len(PROMPTS))
    ]


def test_async_gives_the_same_tokens(sync, overlapped):
    ref = [o.token_ids for o in sync.generate(PROMPTS, SamplingParams(max_tokens=12))]
    params = _params(ref)
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    assert want[0][-1] == ref[0][3] and len(want[0]) <= 4 and len(want[3]) == 1
    before = overlapped.engine.async_steps
    got = [o.token_ids for o in overlapped.generate(PROMPTS, params)]
    assert got == want
    assert overlapped.engine.async_steps - before >= 5  # steps fed on the device


def test_async_sampled_gives_the_same_tokens(sync, overlapped):
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=i) for i in range(len(PROMPTS))]
    params[2] = SamplingParams(max_tokens=10)  # a greedy row in a sampled batch
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    got = [o.token_ids for o in overlapped.generate(PROMPTS, params)]
    assert got == want


def test_step_t_plus_1_is_dispatched_before_step_t_is_fetched(overlapped):
    """The order of the host's calls: decode, decode, fetch, decode, fetch, ... in a steady
    state (each decode dispatched before the previous step's tokens are read)."""
    eng = overlapped.engine
    events = []
    decode, finish = eng.runner.decode, eng._finish_inflight

    def spy_decode(*a, **kw):
        events.append("dispatch")
        return decode(*a, **kw)

    def spy_finish():
        events.append("fetch")
        return finish()

    eng.runner.decode, eng._finish_inflight = spy_decode, spy_finish
    try:
        overlapped.generate(PROMPTS[:2], SamplingParams(max_tokens=8))
    finally:
        del eng.runner.decode, eng._finish_inflight
    steady = "".join("d" if e == "dispatch" else "f" for e in events)
    assert "ddf" in steady and "dfdf" in steady, steady
    assert steady.count("f") >= 6


def test_async_preemption_loses_and_duplicates_nothing(target, sync):
    want = [o.token_ids for o in sync.generate(PROMPTS[:4], SamplingParams(max_tokens=64))]
    layout = sync.layout
    seg = max(layout.unit_bytes(k) for k in ("kv", "state", "snapshot", "stash"))
    kv = int(2.5 * 8 * layout.unit_bytes("kv")) // seg * seg
    llm = LLM(
        target, memory_budget=4 * seg + kv, segment_bytes=seg, async_scheduling=True, **ENGINE
    )
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=64))
    assert [o.token_ids for o in outs] == want
    assert llm.scheduler.preemptions > 0
    assert llm.engine.async_steps > 0
    assert llm.manager.stats()["requests"] == 0  # everything freed


def test_async_scheduling_bad_input(target):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(target, async_scheduling=True, num_scheduler_steps=2, **ENGINE)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(target, async_scheduling="yes", **ENGINE)


@pytest.mark.parametrize("method", ["draft_model", "mtp", "ngram"])
def test_async_speculative_steps_give_the_same_tokens(method):
    """Speculative steps drafted on the device, overlapped (each row's root, length, random
    stream and MTP hidden state or n-gram tokens fed from the step in flight on the device):
    the same tokens as one step at a time, greedy with a stop token and uneven limits, and
    sampled, with requests joining mid-run."""
    from serving import SpecConfig
    from serving.bench import ASSETS

    tiny = dict(dtype="float32", max_num_seqs=4, batch_buckets=(2, 4), max_model_len=96)
    prompts6 = [[5, 6, 7, 8, 9], [9, 10, 11], [40, 41, 42, 43, 44, 45, 46], [3], [7, 7, 8], [60]]
    draft = ASSETS / "draft" if method == "draft_model" else None
    spec = SpecConfig(method=method, draft_model=draft, tree=(2, 1))
    one = LLM(ASSETS / "target", **tiny, speculative=spec)
    ref = [o.token_ids for o in one.generate(prompts6, SamplingParams(max_tokens=13))]
    stop = ref[0][6]
    greedy = [SamplingParams(max_tokens=[13, 13, 7, 10, 9, 12][i]) for i in range(6)]
    greedy[0] = SamplingParams(max_tokens=13, stop_token_ids=[stop])
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in range(6)]
    cases = [greedy] + ([sampled] if method != "mtp" else [])
    llm = LLM(ASSETS / "target", **tiny, speculative=spec, async_scheduling=True)
    for params in cases:
        want = [o.token_ids for o in one.generate(prompts6, params)]
        before = llm.engine.async_steps
        got = [o.token_ids for o in llm.generate(prompts6, params)]
        assert got == want
        assert llm.engine.async_steps - before >= 3
