"""Multi-step decoding (``LLM(num_scheduler_steps=K)``, :meth:`serving.engine.Engine._decode_ahead`):
up to ``K`` greedy decode steps per engine step, each fed the previous one's argmax on the
device, give the same tokens as one step at a time, stop where one-step decoding stops, and
fall back to single steps for sampling and speculation."""

from __future__ import annotations

import pytest

from serving import LLM, SamplingParams, SpecConfig
from serving.bench import ASSETS

TINY = dict(dtype="float32", max_num_seqs=4, batch_buckets=(2, 4), max_model_len=96)
PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11], [40, 41, 42, 43, 44, 45, 46], [3]]


def _run(llm, params):
    calls = []
    inner = llm.engine._decode_ahead

    def spy(reqs, steps):
        calls.append(steps)
        return inner(reqs, steps)

    llm.engine._decode_ahead = spy
    out = llm.generate(PROMPTS, params)
    return [o.token_ids for o in out], calls


@pytest.fixture(scope="module")
def one_step():
    return LLM(ASSETS / "target", **TINY)


def test_steps_ahead_give_the_same_tokens(one_step):
    """Uneven lengths, a ``max_tokens`` that is no multiple of ``K``, per-request limits, a stop
    token met mid-way and a request whose cap ends inside a multi-step run: the same tokens as
    one step at a time, with multi-step runs of at most ``K`` steps actually taken."""
    ref = [o.token_ids for o in one_step.generate(PROMPTS, SamplingParams(max_tokens=11))]
    stop = ref[0][4]  # request 0 stops at its 5th token (and any other that emits it)
    params = [
        SamplingParams(max_tokens=11, stop_token_ids=[stop]),
        SamplingParams(max_tokens=11),
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=9),
    ]
    want = [o.token_ids for o in one_step.generate(PROMPTS, params)]
    assert want[0][-1] == stop and len(want[0]) <= 5
    llm = LLM(ASSETS / "target", **TINY, num_scheduler_steps=4)
    got, calls = _run(llm, params)
    assert got == want
    assert calls and max(calls) == 4 and all(1 < c <= 4 for c in calls)


def test_sampling_and_speculation_take_single_steps():
    """A sampled request, and a speculative engine, never run steps ahead."""
    llm = LLM(ASSETS / "target", **TINY, num_scheduler_steps=4)
    _, calls = _run(llm, SamplingParams(max_tokens=6, temperature=0.8, seed=1))
    assert calls == []
    spec = SpecConfig(method="ngram", tree=(2, 1))
    llm = LLM(ASSETS / "target", **TINY, speculative=spec, num_scheduler_steps=4)
    _, calls = _run(llm, SamplingParams(max_tokens=6))
    assert calls == []


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_bad_scheduler_steps_are_refused(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(ASSETS / "target", **TINY, num_scheduler_steps=bad)
