"""With temperature > 0 speculation is lossless: the emitted next token is distributed as the
target distribution (chi-square over many seeds), for drafts drawn from a draft distribution
(recursive rejection sampling over siblings) and for fixed n-gram proposals."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from serving import LLM, SamplingParams, SpecConfig
from serving.acceptance import rejection_accept, target_probs
from serving.spec_trees import TreeBuilder
from tests.serving.conftest import ENGINE

ALPHA = 1e-3


def _one_level_tree(q, k, rng, proposals):
    tb = TreeBuilder(0, SpecConfig(method="ngram", tree=(k,)), None if proposals else rng)
    tb.expand(0, q, proposals=proposals)
    tb.finish()
    return tb


@pytest.mark.parametrize("proposals", [False, True])
def test_sibling_rejection_sampling_is_lossless(proposals):
    vocab, k, trials = 6, 3, 8000
    gen = np.random.default_rng(0)
    p = gen.dirichlet(np.ones(vocab))
    q = gen.dirichlet(np.ones(vocab))
    counts = np.zeros(vocab)
    for seed in range(trials):
        rng = np.random.default_rng([seed, 7])
        tb = _one_level_tree(q, k, rng, proposals)
        probs = np.tile(p, (len(tb), 1))
        path, nxt = rejection_accept(tb, probs, rng)
        counts[tb.tokens[path[1]] if len(path) > 1 else nxt] += 1
    assert stats.chisquare(counts, trials * p).pvalue > ALPHA


def test_target_probs_top_k_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])


def _second_token_marginal(model, prompt, temperature):
    """Exact distribution of the second generated token: sum_x p(x | prompt) p(. | prompt, x)."""
    v = model.config.vocab_size
    ids = np.array([prompt + [x] for x in range(v)], np.int32)
    logits = np.asarray(model(ids), np.float64)
    first = target_probs(logits[0, len(prompt) - 1], SamplingParams(temperature=temperature))
    second = target_probs(logits[:, -1], SamplingParams(temperature=temperature))
    return first @ second


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model", "draft_model-budget"])
def test_speculative_sampling_matches_target_distribution(method, target, draft):
    prompt = [3, 9, 3, 9, 3, 9, 3]
    temperature, n = 1.5, 600
    shape = dict(budget=6, depth=2, branch=3) if method.endswith("budget") else dict(tree=(3, 2))
    method = method.removesuffix("-budget")
    spec = SpecConfig(
        method=method, draft_model=draft if method == "draft_model" else None, **shape
    )
    llm = LLM(target, speculative=spec, **ENGINE)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=2, temperature=temperature))
    assert all(o.metrics["acceptance_lengths"] for o in outs)  # the 2nd token went through RRS
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=target.config.vocab_size)
    expected = n * _second_token_marginal(target, prompt, temperature)
    big = expected >= 5  # pool the rare tokens into one bin
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    assert stats.chisquare(obs, exp).pvalue > ALPHA
