"""The engine's launch policy (:mod:`serving.launch`): steps up to ``graph_tokens`` tokens
compile as CUDA graphs, larger ones without; both variants compute the same thing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving import LLM, SamplingParams, launch
from serving.bench import ASSETS

TINY = dict(dtype="float32", max_num_seqs=4, batch_buckets=(4,), max_model_len=256)


def test_by_tokens_routes_by_the_step_size():
    f = launch.ByTokens(lambda w, t: jnp.tanh(t * w).sum(-1), 8, 1)
    rng = np.random.default_rng(0)
    w = np.float32(rng.standard_normal())
    small, big = rng.standard_normal((2, 4), np.float32), rng.standard_normal((3, 4), np.float32)
    assert f.pick((w, small)) is f.graphs and f.pick((w, big)) is f.kernels
    np.testing.assert_allclose(f(w, small), np.tanh(small * w).sum(-1), rtol=1e-6)
    assert (f.graphs._cache_size(), f.kernels._cache_size()) == (1, 0)
    np.testing.assert_allclose(f(w, big), np.tanh(big * w).sum(-1), rtol=1e-6)
    assert (f.graphs._cache_size(), f.kernels._cache_size(), f._cache_size()) == (1, 1, 2)
    assert "tanh" in f.lower(w, big).as_text()
    # inside another trace: a plain jit (compiler options are the outer program's)
    inner = jax.jit(lambda w, t: f(w, t) + 1.0)
    np.testing.assert_allclose(inner(w, big), np.tanh(big * w).sum(-1) + 1.0, rtol=1e-6)
    assert "tanh" in str(jax.make_jaxpr(f)(w, small))
    always = launch.jit(lambda t: t * 2.0)
    assert always.pick((big,)) is always.graphs
    with pytest.raises(ValueError, match="graph_tokens"):
        launch.ByTokens(lambda t: t, -1, 0)
    # a packed argument: its rows times 5 tokens (2 x 5 > 8 >= 1 x 5)
    per_row = launch.ByTokens(lambda t: t + 1, 8, 0, count=lambda a: a[0].shape[0] * 5)
    one, two = np.zeros((1, 3), np.int32), np.zeros((2, 3), np.int32)
    assert per_row.pick((one,)) is per_row.graphs and per_row.pick((two,)) is per_row.kernels


@pytest.mark.parametrize("graph_tokens", [0, 1 << 20, None])
def test_engine_steps_take_the_variant_of_their_size(graph_tokens):
    """``cuda_graph_max_tokens=0`` compiles no graph variant, a huge bound and ``None`` (the
    default: every step) only graph variants; the greedy tokens are the same either way."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=4)
    llm = LLM(ASSETS / "target", **TINY, cuda_graph_max_tokens=graph_tokens)
    out = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    for program in (runner._decode_packed, runner._prefill):  # the engine's decode and prefill
        graphs, kernels = program.graphs._cache_size(), program.kernels._cache_size()
        assert (graphs > 0, kernels > 0) == (graph_tokens != 0, graph_tokens == 0)
    ref = LLM(ASSETS / "target", **TINY)
    assert out == [o.token_ids for o in ref.generate(prompts, params)]


def test_bad_graph_bound_is_refused():
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        LLM(ASSETS / "target", **TINY, cuda_graph_max_tokens=-1)
