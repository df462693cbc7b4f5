"""Speculation on the device (:mod:`serving.spec_device`): one program per speculative step,
acceptance equal to the host's (greedy) and lossless (sampling), the static tree laid out as the
host's builder lays it out, and the target distribution under top-k / top-p equal to the
host's."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from serving import LLM, SamplingParams, SpecConfig
from serving import acceptance as host
from serving.drafters import NgramDrafter
from serving.spec_device import (
    BudgetTree,
    StaticTree,
    accept,
    append_history,
    ngram_budget_tree,
    ngram_tree,
    pick_children,
    row_keys,
    sample_rows,
    target_probs,
)
from serving.spec_trees import TreeBuilder
from tests.serving.conftest import ENGINE, prompts

ALPHA = 1e-3


def _builder_layout(widths):
    tb = TreeBuilder(7, SpecConfig(method="ngram", tree=widths), None)
    rng = np.random.default_rng(0)
    level = 0
    while nodes := tb.frontier(level):
        for n in nodes:
            tb.expand(n, rng.dirichlet(np.ones(50)))
        level += 1
    tb.finish()
    return np.asarray(tb.parents, np.int32)


@pytest.mark.parametrize("widths", [(4, 2, 2), (1, 1, 1, 1), (3, 1, 2), (5,)])
def test_static_tree_is_the_host_builders_layout(widths):
    tree = StaticTree(widths)
    np.testing.assert_array_equal(tree.parents, _builder_layout(widths))
    assert tree.num_nodes == SpecConfig(tree=widths).num_nodes


def _check_ngram_tree(seed, spec, vocab, make, tree):
    """Random contexts of 1 to 40 tokens: ``make`` (the device's builder) on them equals the
    host's ``NgramDrafter`` into a greedy ``TreeBuilder``, node for node."""
    rng = np.random.default_rng(seed)
    b, width, n = 4, 48, spec.num_nodes
    lengths = rng.integers(0, 40, b)
    history = rng.integers(0, vocab, (b, width)).astype(np.int32)  # junk past each root
    contexts = [history[i, : lengths[i] + 1] for i in range(b)]
    builders = [TreeBuilder(int(c[-1]), spec, None) for c in contexts]
    NgramDrafter(spec.ngram_max, vocab).draft(contexts, builders)
    tokens, parents = make(
        jnp.asarray(history),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(history[np.arange(b), lengths]),
        tree,
        spec.ngram_max,
    )
    chex.assert_shape([tokens, parents], (b, n))
    for i, tb in enumerate(builders):
        want_tokens, want_parents = tb.arrays(n)
        np.testing.assert_array_equal(np.asarray(tokens[i]), want_tokens)
        np.testing.assert_array_equal(np.asarray(parents[i]), want_parents)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    widths=st.sampled_from([(2, 1), (4, 2, 2), (2, 1, 1, 1, 1), (3,), (1, 1, 1)]),
    vocab=st.sampled_from([3, 6, 12, 1000]),
    ngram_max=st.integers(1, 4),
)
def test_ngram_tree_is_the_host_drafters(seed, widths, vocab, ngram_max):
    """The n-gram drafter's static tree on the device equals the host's node for node: small
    vocabularies (many matches, ties between counts) and a large one (mostly none, nodes
    without children)."""
    spec = SpecConfig(method="ngram", tree=widths, ngram_max=ngram_max)
    _check_ngram_tree(seed, spec, vocab, ngram_tree, StaticTree(widths))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(10, 3, 3), (6, 4, 2), (16, 3, 4), (4, 2, 2), (2, 5, 1)]),
    vocab=st.sampled_from([3, 6, 12, 1000]),
    ngram_max=st.integers(1, 4),
)
def test_ngram_budget_tree_is_the_host_drafters(seed, shape, vocab, ngram_max):
    """The n-gram drafter's budget tree on the device equals the host's node for node, on
    contexts whose counts tie often (small vocabularies: the float32 ranking sums tie alike on
    both) and on ones with few matches."""
    budget, depth, branch = shape
    spec = SpecConfig(
        method="ngram", budget=budget, depth=depth, branch=branch, ngram_max=ngram_max
    )
    _check_ngram_tree(seed, spec, vocab, ngram_budget_tree, BudgetTree(budget, depth, branch))


def test_append_history_writes_each_rows_emitted_tokens_after_its_root():
    history = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)
    out = np.asarray([[50, 51, 52], [60, 61, 62]], np.int32)
    got = append_history(jnp.asarray(history), jnp.asarray([2, 6]), out, jnp.asarray([2, 3]))
    want = history.copy()
    want[0, 3:5] = [50, 51]  # two emitted tokens after the root at 2
    want[1, 7] = 60  # three after the root at 6: the last two fall off the end
    np.testing.assert_array_equal(np.asarray(got), want)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
)
def test_target_probs_matches_host(seed, top_k, top_p, temperature):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(3, 40)).astype(np.float32) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(
        jnp.asarray(logits),
        jnp.full(3, temperature, jnp.float32),
        jnp.full(3, top_k, jnp.int32),
        jnp.full(3, top_p, jnp.float32),
    )
    want = host.target_probs(logits, params)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def _random_tree(rng, n, width, vocab):
    """A random level-free tree (parents before children, at most ``width`` children per
    node, distinct sibling tokens) padded to ``n`` nodes with parent ``-2``."""
    size = int(rng.integers(1, n + 1))
    parents, tokens, kids = [-1], [int(rng.integers(vocab))], {0: set()}
    for i in range(1, size):
        options = [p for p in range(i) if len(kids[p]) < width]
        p = int(rng.choice(options))
        free = [t for t in range(vocab) if t not in kids[p]]
        t = int(rng.choice(free))
        kids[p].add(t)
        kids[i] = set()
        parents.append(p)
        tokens.append(t)
    pad = n - size
    return np.array(tokens + [0] * pad, np.int32), np.array(parents + [-2] * pad, np.int32)


def _host_tree(tokens, parents):
    tb = TreeBuilder(int(tokens[0]), SpecConfig(method="ngram", tree=(1,)), None)
    live = parents != -2
    tb.tokens = [int(t) for t in tokens[live]]
    tb.parents = [int(p) for p in parents[live]]
    return tb


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_greedy_acceptance_matches_host(seed):
    rng = np.random.default_rng(seed)
    b, n, vocab, width, depth = 4, 12, 5, 3, 11
    trees = [_random_tree(rng, n, width, vocab) for _ in range(b)]
    tokens = np.stack([t for t, _ in trees])
    parents = np.stack([p for _, p in trees])
    logits = rng.normal(size=(b, n, vocab)).astype(np.float32)
    # make the argmax follow the tree often: bump the logit of a random child's token
    for i in range(b):
        for node in range(n):
            kids = np.nonzero(parents[i] == node)[0]
            if kids.size and rng.random() < 0.7:
                logits[i, node, tokens[i, rng.choice(kids)]] += 5.0
    zeros = jnp.zeros(b, jnp.float32)
    path, path_len, nxt = accept(
        jnp.asarray(tokens),
        jnp.asarray(parents),
        jnp.asarray(logits),
        None,
        depth=depth,
        width=width,
        temperature=zeros,
        top_k=jnp.zeros(b, jnp.int32),
        top_p=jnp.ones(b, jnp.float32),
        keys=row_keys(jnp.zeros((b, 3), jnp.uint32)),
    )
    path, path_len, nxt = np.asarray(path), np.asarray(path_len), np.asarray(nxt)
    for i in range(b):
        want_path, want_next = host.greedy_accept(
            _host_tree(tokens[i], parents[i]), logits[i].argmax(-1)
        )
        assert path[i, : path_len[i]].tolist() == want_path
        assert (path[i, path_len[i] :] == -1).all()
        assert nxt[i] == want_next


@pytest.mark.parametrize("proposals", [False, True])
def test_device_rejection_sampling_is_lossless(proposals):
    """One level of ``k`` siblings drawn on the device (Gumbel top-k from ``q``, or fixed
    proposals), accepted on the device: the emitted token is distributed as ``p``, over many
    rows of one call."""
    vocab, k, rows = 6, 3, 12000
    gen = np.random.default_rng(5)
    p_logits = np.log(gen.dirichlet(np.ones(vocab)))
    q_logits = np.log(gen.dirichlet(np.ones(vocab)))
    temp = jnp.ones(rows, jnp.float32)
    seeds = np.stack([np.arange(rows), np.full(rows, 3), np.zeros(rows)], 1).astype(np.uint32)
    keys = row_keys(jnp.asarray(seeds))
    q = jnp.broadcast_to(jnp.asarray(q_logits, jnp.float32), (rows, 1, vocab))
    if proposals:
        fixed = gen.choice(vocab, k, replace=False)
        kids = jnp.broadcast_to(jnp.asarray(fixed, jnp.int32), (rows, k))
        draft_logits = None
    else:
        kids = pick_children(q, k, temp, jax.vmap(lambda kk: jax.random.fold_in(kk, 9))(keys))
        kids = kids[:, 0]
        draft_logits = jnp.concatenate([q, jnp.zeros((rows, k, vocab), jnp.float32)], axis=1)
    tokens = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), kids], axis=1)
    parents = jnp.broadcast_to(jnp.asarray([-1] + [0] * k, jnp.int32), (rows, k + 1))
    target_logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (rows, k + 1, vocab))
    path, path_len, nxt = accept(
        tokens,
        parents,
        target_logits,
        draft_logits,
        depth=1,
        width=k,
        temperature=temp,
        top_k=jnp.zeros(rows, jnp.int32),
        top_p=jnp.ones(rows, jnp.float32),
        keys=keys,
    )
    path, path_len, nxt, tokens = map(np.asarray, (path, path_len, nxt, tokens))
    first = np.where(path_len > 1, tokens[np.arange(rows), np.maximum(path[:, 1], 0)], nxt)
    counts = np.bincount(first, minlength=vocab)
    assert 0.05 < (path_len > 1).mean() < 1.0  # both branches of the test run
    assert stats.chisquare(counts, rows * np.exp(p_logits)).pvalue > ALPHA


def test_one_device_program_per_speculative_step(target, draft):
    llm = LLM(
        target,
        speculative=SpecConfig(method="draft_model", draft_model=draft, tree=(2, 2)),
        **ENGINE,
    )
    engine = llm.engine
    assert engine.device_spec is not None
    calls = []
    for obj, names in (
        (engine.runner, ("prefill", "decode", "verify", "commit", "tree_logits")),
        (engine.draft_runner, ("prefill", "tree_logits")),
    ):
        for name in names:
            fn = getattr(obj, name)

            def counted(*a, _fn=fn, _name=name, **k):
                calls.append(_name)
                return _fn(*a, **k)

            setattr(obj, name, counted)
    outs = llm.generate(prompts(3), SamplingParams(max_tokens=12))
    steps = sum(len(o.metrics["acceptance_lengths"]) for o in outs)
    assert steps > 0
    # prefill alone goes through the runners (target and draft); every speculative step is
    # the one device program
    assert set(calls) <= {"prefill"}
    assert engine.device_spec.calls >= max(len(o.metrics["acceptance_lengths"]) for o in outs)


DEVICE_VS_HOST = {
    "draft-422": dict(method="draft_model"),
    "mtp-budget10": dict(method="mtp", budget=10, depth=3, branch=3),
    "draft-budget12-snapshot": dict(
        method="draft_model", budget=12, depth=3, branch=3, verify="snapshot"
    ),
    "ngram-32": dict(method="ngram", tree=(3, 2)),
    "ngram-budget10": dict(method="ngram", budget=10, depth=3, branch=3),
}


@pytest.mark.parametrize("name", list(DEVICE_VS_HOST))
def test_device_and_host_paths_give_the_same_greedy_tokens(name, target, draft):
    """Same tokens and the same trees (so the same acceptance lengths): static and dynamic
    trees drafted on the device match the host's builder."""
    kw = DEVICE_VS_HOST[name]
    spec = SpecConfig(**kw, draft_model=draft if kw["method"] == "draft_model" else None)
    ps, params = prompts(3), SamplingParams(max_tokens=16)
    on_device = LLM(target, speculative=spec, **ENGINE)
    assert on_device.engine.device_spec is not None
    on_host = LLM(target, speculative=spec, **ENGINE)
    on_host.engine.device_spec = None
    a = on_device.generate(ps, params)
    b = on_host.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.metrics["acceptance_lengths"] for o in a] == [
        o.metrics["acceptance_lengths"] for o in b
    ]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_device_sampling_draws_the_target_distribution(top_k, top_p):
    """Plain decoding's draws on the device (``sample_rows``): distributed as the host's
    ``target_probs`` under temperature, top-k and top-p; greedy rows take the argmax."""
    vocab, rows = 7, 12000
    logits = np.log(np.random.default_rng(2).dirichlet(np.ones(vocab))).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p)
    want = host.target_probs(logits, params)
    seeds = np.stack([np.full(rows, 11), np.arange(rows), np.full(rows, 5)], 1).astype(np.uint32)
    temp = np.full(rows, 1.3, np.float32)
    temp[:100] = 0.0  # greedy rows
    got = np.asarray(
        sample_rows(
            jnp.broadcast_to(jnp.asarray(logits), (rows, vocab)),
            jnp.asarray(seeds),
            jnp.asarray(temp),
            jnp.full(rows, top_k, jnp.int32),
            jnp.full(rows, top_p, jnp.float32),
        )
    )
    assert (got[:100] == logits.argmax()).all()
    counts = np.bincount(got[100:], minlength=vocab)
    assert counts[want == 0].sum() == 0
    keep = want > 0
    assert stats.chisquare(counts[keep], (rows - 100) * want[keep]).pvalue > ALPHA
