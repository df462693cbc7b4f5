"""A steady state compiles nothing: a second generate over the same shapes reuses every
jitted program."""

from __future__ import annotations

from serving import LLM, SamplingParams, SpecConfig
from tests.serving.conftest import ENGINE, prompts


def test_no_recompilation_in_steady_state(target):
    llm = LLM(target, speculative=SpecConfig(method="ngram", tree=(4, 2, 2)), **ENGINE)
    params = SamplingParams(max_tokens=12)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=4)
    # the warm-up sees a greedy and a sampled batch: a speculative step compiles one program
    # per bucket for all-greedy batches and one for batches that sample
    llm.generate(prompts(5, seed=1), params)
    llm.generate(prompts(2, seed=5), sampled)
    warm = llm.compiled_programs()
    assert warm > 0
    llm.generate(prompts(7, seed=2), params)
    llm.generate(prompts(3, seed=3), sampled)
    assert llm.compiled_programs() == warm
