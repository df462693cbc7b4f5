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


def test_step_programs_compile_without_xla_rematerialization(monkeypatch):
    """Both variants carry the launch options and switch XLA's rematerialization pass off
    (the compiler accepts the options: the program compiles and runs); on a TPU the pass is
    left alone, and ``REMAT_OFF = False`` leaves it on everywhere."""
    f = launch.ByTokens(lambda t: jnp.cos(t) * 2.0, 4, 0)
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(f(x), np.cos(x) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(f.kernels(x), np.cos(x) * 2.0, rtol=1e-6)
    for graphs in (True, False):
        opts = launch.options(graphs)
        assert opts["xla_disable_hlo_passes"] == "rematerialization", opts
        assert ("xla_gpu_enable_command_buffer" in opts) == (not graphs)
    monkeypatch.setattr(launch.jax, "default_backend", lambda: "tpu")
    assert "xla_disable_hlo_passes" not in launch.options(True)
    monkeypatch.undo()
    monkeypatch.setattr(launch, "REMAT_OFF", False)
    assert launch.options(False) == launch.NO_GRAPHS


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


def _compiles():
    """A counter of XLA compilations from here on."""
    n = [0]

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    return n


def test_a_program_that_cannot_fit_is_refused_before_its_launch(monkeypatch):
    """Where the device reports its memory, a step program's first call compiles it ahead,
    and one whose temporaries and outputs exceed the free bytes raises a ValueError naming
    the engine's knobs instead of failing in the launch; one that fits compiles once and
    runs; the check runs once per program, not per call."""
    f = launch.ByTokens(lambda w, t: jnp.tanh(t[:, :, None] * w).sum(-1), None, 1)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal(64), jnp.float32)
    t = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    want = np.tanh(np.asarray(t)[:, :, None] * np.asarray(w)).sum(-1)
    checks = []
    real_check = launch.check_fits
    monkeypatch.setattr(launch, "check_fits", lambda *a: (checks.append(1), real_check(*a))[1])
    monkeypatch.setattr(launch, "free_bytes", lambda device: 8)
    with pytest.raises(ValueError, match="memory_budget / max_num_seqs.* 8 B free"):
        f(w, t)
    assert f._cache_size() == 0  # nothing ran
    monkeypatch.setattr(launch, "free_bytes", lambda device: 1 << 40)
    compiles = _compiles()
    np.testing.assert_allclose(f(w, t), want, rtol=1e-5)
    np.testing.assert_allclose(f(w, t + 0.0), want, rtol=1e-5)
    assert compiles[0] == 1 and f._cache_size() == 1  # the call reused the checked program
    assert len(checks) == 2  # the refused call and the first that fit
    f(w, t[:4])  # another shape: another program, checked
    assert len(checks) == 3

    # a compile that runs out of memory (XLA's autotuner allocates on the device) says so too
    class _Lowered:
        def compile(self):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: ... RESOURCE_EXHAUSTED: Out of memory")

    class _Fn:
        def lower(self, *a, **k):
            return _Lowered()

    with pytest.raises(ValueError, match="compiling a step program .* ran out of device memory"):
        launch.check_fits(_Fn(), (t,), {})
    monkeypatch.setattr(launch, "free_bytes", lambda device: None)  # CPU: nothing to check
    g = launch.jit(lambda t: t * 2.0)
    np.testing.assert_allclose(g(t), 2 * np.asarray(t))


def test_engine_refuses_a_step_that_cannot_fit(monkeypatch):
    """The engine's first step surfaces the check as a ValueError naming its knobs (a shape
    of its own: programs are shared by engines of one configuration, and checked once)."""
    monkeypatch.setattr(launch, "free_bytes", lambda device: 4096)
    llm = LLM(ASSETS / "target", **{**TINY, "max_model_len": 96})
    with pytest.raises(ValueError, match="memory_budget / max_num_seqs"):
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
