"""A steady state compiles nothing: a second generate over the same shapes reuses every
jitted program."""

from __future__ import annotations

from serving import LLM, SamplingParams, SpecConfig
from tests.serving.conftest import ENGINE, prompts


def test_no_recompilation_in_steady_state(target):
    llm = LLM(target, speculative=SpecConfig(method="ngram", tree=(4, 2, 2)), **ENGINE)
    params = SamplingParams(max_tokens=12)
    llm.generate(prompts(5, seed=1), params)
    warm = llm.compiled_programs()
    assert warm > 0
    llm.generate(prompts(7, seed=2), params)
    llm.generate(prompts(3, seed=3), SamplingParams(max_tokens=12, temperature=0.8, seed=4))
    assert llm.compiled_programs() == warm
