"""Multi-step decoding (``LLM(num_scheduler_steps=K)``, :meth:`serving.engine.Engine._decode_ahead`
and ``_speculate_ahead``): up to ``K`` plain decode steps, or speculative steps drafted on the
device, per engine step, each fed the previous one's tokens on the device, give the same
tokens as one step at a time, greedy or sampled, and stop where one-step decoding stops;
trees a host drafter builds take single steps."""

from __future__ import annotations

import dataclasses

import pytest

from serving import LLM, SamplingParams, SpecConfig
from serving.bench import ASSETS
from serving.drafters import NgramDrafter

TINY = dict(dtype="float32", max_num_seqs=4, batch_buckets=(2, 4), max_model_len=96)
PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11], [40, 41, 42, 43, 44, 45, 46], [3]]


def _run(llm, params, ahead="_decode_ahead"):
    """Tokens of ``PROMPTS`` and the step counts of the engine's ``ahead`` method's calls."""
    calls = []
    inner = getattr(llm.engine, ahead)

    def spy(reqs, steps):
        calls.append(steps)
        return inner(reqs, steps)

    setattr(llm.engine, ahead, spy)
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


def test_sampled_steps_ahead_give_the_same_tokens(one_step):
    """Sampled plain decoding (temperature, top-k, top-p, per-request seeds; one greedy row in
    the batch) chained on the device: each draw keyed by its output position, so the same
    tokens as one step at a time."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, seed=3),
        SamplingParams(max_tokens=7, temperature=1.3, top_k=5, seed=4),
        SamplingParams(max_tokens=10),
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, seed=5),
    ]
    want = [o.token_ids for o in one_step.generate(PROMPTS, params)]
    llm = LLM(ASSETS / "target", **TINY, num_scheduler_steps=4)
    got, calls = _run(llm, params)
    assert got == want
    assert calls and max(calls) == 4
    # the draws depend on the seeds: another seed changes some token
    other = [dataclasses.replace(p, seed=p.seed + 10) for p in params]
    assert [o.token_ids for o in llm.generate(PROMPTS, other)] != want


def test_host_drafts_take_single_steps():
    """Speculation on trees the host builds never runs steps ahead: a host drafter put in
    place of the n-gram one on a static tree (whose trees the step then verifies instead of
    drafting its own)."""

    class Counting(NgramDrafter):
        calls = 0

        def draft(self, contexts, builders, **kw):
            Counting.calls += 1
            return super().draft(contexts, builders, **kw)

    spec = SpecConfig(method="ngram", tree=(2, 1))
    want = [
        o.token_ids
        for o in LLM(ASSETS / "target", **TINY).generate(PROMPTS, SamplingParams(max_tokens=6))
    ]
    llm = LLM(ASSETS / "target", **TINY, speculative=spec, num_scheduler_steps=4)
    llm.engine.drafter = Counting(spec.ngram_max, llm.config.vocab_size)
    got, calls = _run(llm, SamplingParams(max_tokens=6), ahead="_speculate_ahead")
    assert calls == [] and Counting.calls > 0 and got == want


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_bad_scheduler_steps_are_refused(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(ASSETS / "target", **TINY, num_scheduler_steps=bad)


@pytest.mark.parametrize("method", ["draft_model", "mtp", "ngram", "ngram-budget"])
def test_speculative_steps_ahead_give_the_same_tokens(method):
    """Speculative steps chained on the device (``num_scheduler_steps=K`` with a drafter on
    the device): the same tokens as one step at a time, greedy with a stop token met mid-way
    and uneven ``max_tokens``, and sampled (each row's random stream advanced on the device by
    its emitted tokens), with chained runs of more than one step actually taken; the n-gram
    drafter on a static tree and on a budget tree."""
    draft = ASSETS / "draft" if method == "draft_model" else None
    if method == "ngram-budget":
        spec = SpecConfig(method="ngram", budget=4, depth=2, branch=2)
    else:
        spec = SpecConfig(method=method, draft_model=draft, tree=(2, 1))
    one = LLM(ASSETS / "target", **TINY, speculative=spec)
    ref = [o.token_ids for o in one.generate(PROMPTS, SamplingParams(max_tokens=13))]
    stop = ref[0][6]
    greedy = [
        SamplingParams(max_tokens=13, stop_token_ids=[stop]),
        SamplingParams(max_tokens=13),
        SamplingParams(max_tokens=7),
        SamplingParams(max_tokens=10),
    ]
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in range(4)]
    cases = [greedy] + ([sampled] if method != "mtp" else [])
    llm = LLM(ASSETS / "target", **TINY, speculative=spec, num_scheduler_steps=3)
    wants = []
    for params in cases:
        wants.append([o.token_ids for o in one.generate(PROMPTS, params)])
        got, calls = _run(llm, params, ahead="_speculate_ahead")
        assert got == wants[-1]
        assert calls and all(1 < c <= 3 for c in calls)
    assert wants[-1] != ref or method == "mtp"  # the sampled case drew its own tokens
