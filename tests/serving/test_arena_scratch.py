"""The speculative scratch lives in the arena: the arena runner's verify writes the draft tree's
state (tree WY: each row's ``stash`` unit; snapshot: its ``N`` ``snapshot`` units) into the
request's scratch units through the donated arena, and commit reads it back from there.

- greedy tokens with the scratch in the arena equal plain greedy decoding (both verify methods;
  XLA and the Pallas kernels in interpret mode);
- after a verify, the rows' scratch units hold exactly the tree state the transient path
  (``verify`` without ``scratch``) returns, bit for bit, every other arena word is unchanged,
  and padding rows write nothing; a commit from the units gives the transient commit's arena;
- verify hands back nothing but logits, argmax, hidden states and the arena (donated: the old
  buffer is gone), i.e. no tree-state array outlives the step outside the arena.

The geometry (page_size 16, the same SpecConfig) is test_arena_kernels_engine's, so a session
running both compiles the shared programs once."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from gdn_jax import TreeCache
from gdn_jax.models import steps
from serving import LLM, SamplingParams, SpecConfig
from serving.arena_cache import ArenaCache
from serving.memory.arena import field_to_words
from serving.memory.layout import WORD_BYTES
from serving.runner import ArenaRunner
from tests.serving.conftest import ENGINE, VOCAB, host_speculation, prompts, tiny_config
from tests.serving.test_arena_kernels_engine import _primitives

GEOM = dict(ENGINE, page_size=16, memory_budget=2 << 20)
SPECS = {
    "wy": SpecConfig(method="ngram", tree=(2, 2)),  # N = 7 nodes, depth 2
    "snapshot": SpecConfig(method="ngram", tree=(2, 2), verify="snapshot"),
}
PROMPTS = prompts(4, seed=0)
PARAMS = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in LLM(target, **GEOM).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def llms(target):
    return {
        (v, k): host_speculation(LLM(target, speculative=SPECS[v], kernels=k, **GEOM))
        for v in SPECS
        for k in ("xla", "pallas")
    }


def _scratch_kind(verify: str) -> str:
    return "snapshot" if verify == "snapshot" else "stash"


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
@pytest.mark.parametrize("verify", ["wy", "snapshot"])
def test_greedy_tokens_with_scratch_in_the_arena(verify, kernels, llms, plain):
    llm = llms[verify, kernels]
    runner = llm.runner
    assert runner.kernels == kernels
    n = SPECS[verify].num_nodes
    seen = []

    def spy(*a, **k):
        out = type(runner).verify(runner, *a, **k)
        seen.append((np.asarray(k["scratch"]).copy(), out[3]))
        return out

    runner.verify = spy
    try:
        outs = llm.generate(PROMPTS, PARAMS)
    finally:
        del runner.verify
    assert [o.token_ids for o in outs] == plain
    assert max(max(o.metrics["acceptance_lengths"]) for o in outs) > 1  # commits of paths > 1
    assert seen
    for scratch, tree in seen:
        # the engine passed the requests' scratch handles (padding rows -1); verify handed back
        # those handles, not a tree-state array
        assert scratch.dtype == np.int32 and scratch.shape == (
            (4, n) if verify == "snapshot" else (4,)
        )
        assert isinstance(tree, np.ndarray) and np.array_equal(tree, scratch)
        assert (scratch >= 0).any()
    assert llm.manager.stats()["requests"] == 0  # every scratch unit freed with its request


def _batch(llm, verify, seed):
    """Two prefilled rows (lengths 21 and 9) with state, KV and scratch units, two padding rows
    (``-1``); a draft tree with a padding node; accepted paths of 3, 2, 0, 0 nodes. The rows'
    scratch units first get random bits (NaN patterns included), so every word verify leaves
    there is its own."""
    rng = np.random.default_rng(seed)
    mm, runner = llm.manager, llm.runner
    spec = SPECS[verify]
    b, mp, n = 4, llm.scheduler.pages_per_seq, spec.num_nodes
    kind = _scratch_kind(verify)
    handles = np.full(b, -1, np.int32)
    pages = np.full((b, mp), -1, np.int32)
    scratch = np.full((b, n) if kind == "snapshot" else (b,), -1, np.int32)
    lens = np.array([21, 9, 0, 0], np.int32)
    rows = [("scratch", verify, seed, i) for i in range(2)]
    for i, rid in enumerate(rows):
        handles[i] = mm.alloc(rid, "state")[0]
        pages[i, :2] = mm.alloc(rid, "kv", 2)
        got = mm.alloc(rid, kind, n if kind == "snapshot" else 1)
        scratch[i] = got if kind == "snapshot" else got[0]
    for start in (0, 16):  # prefill in chunks of 16 (the engine's program)
        count = np.clip(lens - start, 0, 16).astype(np.int32)
        tok = rng.integers(0, VOCAB, (b, 16)).astype(np.int32)
        runner.prefill(handles, pages, np.minimum(lens, start).astype(np.int32), tok, count)
    buf = np.asarray(mm.arena.buffer).copy()
    for _, k, rid, seg, word, words in mm.live():
        if rid in rows and k == kind:
            buf[seg, word : word + words] = rng.integers(0, 2**32, words, dtype=np.uint32)
    mm.arena.buffer = jax.device_put(buf, mm.arena.buffer.device)
    parents = np.tile(np.array([-1, 0, 0, 1, 2, 1, -2], np.int32), (b, 1))
    tokens = rng.integers(0, VOCAB, (b, n)).astype(np.int32)
    path = np.full((b, spec.max_depth + 1), -1, np.int32)
    path[0], path[1, :2] = [0, 1, 3], [0, 2]
    path_len = np.array([3, 2, 0, 0], np.int32)
    return rows, (handles, pages, lens), tokens, parents, scratch, path, path_len


def _words(x, dtype) -> np.ndarray:
    """``x`` as the arena stores it: ``uint32`` words, bit for bit."""
    return np.asarray(field_to_words(x[None].astype(dtype), 1))[0]


def _stash_want(tree, b):
    return {
        "u": np.stack([tc.u[b] for tc in tree.gdn]),
        "k": np.stack([tc.k[b] for tc in tree.gdn]),
        "g": np.stack([tc.g_path[b] for tc in tree.gdn]),
        "x": tree.conv_in[:, b],
        "dk": tree.draft_k[:, b],
        "dv": tree.draft_v[:, b],
    }


def _check_units(mm, sp, tree, scratch, exact: bool):
    """The rows' scratch units against ``tree`` (host arrays): bit for bit when ``exact``, else
    to f32 rounding (a tree computed by another program: XLA fuses, so rounds, differently)."""

    def same(got, want, dtype, what):
        want = np.asarray(want).astype(dtype)
        if exact:
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), what)
        else:
            # 1e-4: on the H200 one draft-K value of 112 differed by 1.9e-6 (7.7e-5 relative);
            # a field swap or misplaced window differs by O(1)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=what)

    for b in range(2):
        if scratch.ndim == 1:  # the stash unit: every field
            assert all(isinstance(tc, TreeCache) for tc in tree.gdn)
            want = _stash_want(tree, b)
            for f in mm.fields("stash"):
                got = np.asarray(mm.read("stash", int(scratch[b]), f.name))
                same(got, want[f.name], f.dtype, f"row {b} stash field {f.name}")
            continue
        for node in range(scratch.shape[1]):  # one snapshot unit per node
            h = int(scratch[b, node])
            states = np.stack([s[b, node] for s in tree.gdn])  # [Lg, Hv, K, V]
            got = np.asarray(mm.read("snapshot", h, "recurrent"))
            same(got, states, np.float32, f"row {b} node {node} states")
            # its conv field starts with the node's pre-conv inputs, then its draft K and V
            conv = np.asarray(mm.read("snapshot", h, "conv")).reshape(-1).view(np.uint8)
            x, k, v = (
                np.asarray(tree.conv_in[:, b, node]),
                np.asarray(tree.draft_k[:, b, node]),
                np.asarray(tree.draft_v[:, b, node]),
            )
            xw = _words(x, sp.conv_dtype).size * WORD_BYTES
            kw = _words(k, sp.kv_dtype).size * WORD_BYTES
            assert xw + 2 * kw <= sp.gdn_layers * sp.conv_words * WORD_BYTES
            for what, raw, want, dtype in (
                ("conv_in", conv[: x.nbytes], x, sp.conv_dtype),
                ("draft_k", conv[xw : xw + k.nbytes], k, sp.kv_dtype),
                ("draft_v", conv[xw + kw : xw + kw + v.nbytes], v, sp.kv_dtype),
            ):
                got = raw.view(np.dtype(dtype)).reshape(want.shape)
                same(got, want, dtype, f"row {b} node {node} {what}")


@pytest.mark.parametrize("verify, kernels", [("wy", "xla"), ("wy", "pallas"), ("snapshot", "xla")])
def test_verify_writes_the_tree_state_into_the_scratch_units(verify, kernels, llms):
    llm = llms[verify, kernels]
    mm, runner = llm.manager, llm.runner
    sp = runner.spec
    snapshot = verify == "snapshot"
    rows, cache_rows, tokens, parents, scratch, path, path_len = _batch(llm, verify, seed=5)
    base = np.asarray(mm.arena.buffer).copy()
    kind = _scratch_kind(verify)
    other = np.ones(base.shape, bool)  # every word outside the two rows' scratch units
    for _, k, rid, seg, word, words in mm.live():
        if rid in rows and k == kind:
            other[seg, word : word + words] = False
    assert not other.all()

    # the transient path: the tree state as a device value, the arena only read
    ref_logits, _, _, tree = runner.verify(*cache_rows, tokens, parents, snapshot=snapshot)
    assert np.array_equal(np.asarray(mm.arena.buffer), base)
    runner.commit(*cache_rows, tree, path, path_len)
    ref_after = np.asarray(mm.arena.buffer)
    tree = jax.tree.map(np.asarray, tree)

    # the engine's path: the tree state written into the scratch units, in place
    mm.arena.buffer = jax.device_put(base, mm.arena.buffer.device)
    old = mm.arena.buffer
    logits, _, _, got = runner.verify(
        *cache_rows, tokens, parents, snapshot=snapshot, scratch=scratch
    )
    assert old.is_deleted()  # the arena was donated
    assert np.array_equal(got, scratch)
    lx = np.asarray(ref_logits)[:2]
    np.testing.assert_allclose(np.asarray(logits)[:2], lx, rtol=1e-5, atol=1e-5)
    after = np.asarray(mm.arena.buffer)
    np.testing.assert_array_equal(after[other], base[other])  # padding rows wrote nothing
    _check_units(mm, sp, tree, scratch, exact=False)

    # the commit reads the tree state back from the units: the transient commit's arena
    runner.commit(*cache_rows, got, path, path_len)
    final = np.asarray(mm.arena.buffer)
    np.testing.assert_allclose(
        final[other].view(np.float32), ref_after[other].view(np.float32), rtol=1e-5, atol=1e-5
    )
    live = np.zeros(base.shape, bool)
    for _, k, rid, seg, word, words in mm.live():
        span = slice(word, word + words)
        live[seg, span] = True
        if rid in rows and k == "state":  # the commit wrote the rows' states
            assert not np.array_equal(final[seg, span], base[seg, span])
    np.testing.assert_array_equal(final[~live], base[~live])  # free words: untouched

    mm.arena.buffer = jax.device_put(base, mm.arena.buffer.device)
    _roundtrip_is_exact(llm, verify, cache_rows, tokens, parents, scratch, path, path_len, other)
    for rid in rows:
        mm.free(rid)


def _roundtrip_is_exact(llm, verify, cache_rows, tokens, parents, scratch, path, path_len, other):
    """Bit for bit, in one program: after ``write_tree_state`` the units hold exactly the tree
    state that program's ``verify_tree`` computed (no other word of the arena changes), and
    ``read_tree_state`` gives it back exactly."""
    mm, runner = llm.manager, llm.runner
    sp, snapshot = runner.spec, verify == "snapshot"
    base = np.asarray(mm.arena.buffer)

    def write_read(buf, table, handles, pages, lengths, tokens, parents, scratch, path, plen):
        cache = ArenaCache(buf, table, handles, pages, lengths, sp, runner.kernel_choice)
        m = nnx.merge(*nnx.split(llm.model))
        _, t, _ = steps.verify_tree(
            m, tokens, parents, cache, return_hidden=True, snapshot=snapshot
        )
        cache = cache.write_tree_state(t, scratch)
        return t, cache.buffer, cache.read_tree_state(scratch, path, plen, qk_l2norm=True)

    t, buf, back = jax.jit(write_read)(
        mm.arena.buffer, runner.table(), *cache_rows, tokens, parents, scratch, path, path_len
    )
    mm.arena.buffer = buf
    t, back = jax.tree.map(np.asarray, t), jax.tree.map(np.asarray, back)
    np.testing.assert_array_equal(np.asarray(buf)[other], base[other])
    _check_units(mm, sp, t, scratch, exact=True)

    def bits(x):
        return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)

    for name in ("conv_in", "draft_k", "draft_v"):
        got, want = getattr(back, name)[:, :2], getattr(t, name)[:, :2]
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(bits(got), bits(want), name)
    for gi, (tb, tt) in enumerate(zip(back.gdn, t.gdn, strict=True)):
        if snapshot:  # the accepted leaf's states only
            for b in range(2):
                leaf = path[b, path_len[b] - 1]
                np.testing.assert_array_equal(bits(tb[b, 0]), bits(tt[b, leaf]), f"layer {gi}")
            continue
        for f in ("u", "k", "g_path"):
            got, want = getattr(tb, f)[:2], getattr(tt, f)[:2]
            assert got.dtype == want.dtype, f
            np.testing.assert_array_equal(bits(got), bits(want), f"layer {gi} {f}")


@pytest.mark.parametrize("verify", ["wy", "snapshot"])
def test_scratch_roundtrip_is_exact_in_bfloat16(verify):
    """The engine's bf16 layout (keys, pre-conv inputs and draft K/V two to a word): the units
    hold the tree state and give it back bit for bit."""
    llm = LLM(
        tiny_config(), speculative=SPECS[verify], kernels="xla", **dict(GEOM, dtype="bfloat16")
    )
    assert llm.runner.spec.kv_dtype == llm.runner.spec.conv_dtype == "bfloat16"
    rows, cache_rows, tokens, parents, scratch, path, path_len = _batch(llm, verify, seed=7)
    mm = llm.manager
    other = np.ones(mm.arena.buffer.shape, bool)
    for _, k, rid, seg, word, words in mm.live():
        if rid in rows and k == _scratch_kind(verify):
            other[seg, word : word + words] = False
    _roundtrip_is_exact(llm, verify, cache_rows, tokens, parents, scratch, path, path_len, other)
    for rid in rows:
        mm.free(rid)


@pytest.mark.parametrize("verify", ["wy", "snapshot"])
def test_verify_returns_no_tree_state_and_kernels_stay_wired(verify, llms):
    """The verify program's outputs are the logits, argmax and hidden states of the nodes and
    the arena itself (aliased to the donated input): no tree-state array. With the Pallas
    kernels the tree-WY verify and commit programs still gather / scatter no GDN state window
    (the kernels read the states in place; the commit kernel gets the stash's fields)."""
    snapshot = verify == "snapshot"
    llm = llms[verify, "xla"]
    mm = llm.manager
    rows, cache_rows, tokens, parents, scratch, path, path_len = _batch(llm, verify, seed=6)
    sp = llm.runner.spec
    for k in ("xla", "pallas"):
        runner = ArenaRunner(llm.model, mm, kernels=k)  # a second runner on the same arena
        args = (runner._state, mm.arena.buffer, runner.table(), *cache_rows, tokens, parents)
        outs = jax.eval_shape(lambda *a, r=runner: r._verify(*a, snapshot=snapshot), *args, scratch)
        b, n = tokens.shape
        assert [o.shape for o in outs] == [
            (b, n, VOCAB),
            (b, n),
            (b, n, llm.config.hidden_size),
            mm.arena.buffer.shape,
        ]
        small = sum(np.prod(o.shape) * o.dtype.itemsize for o in outs[:3])
        assert small <= b * n * (VOCAB + llm.config.hidden_size + 1) * 4
        lowered = runner._verify.lower(*args, scratch, snapshot=snapshot).as_text()
        assert "tf.aliasing_output = 3" in lowered  # the arena in, the arena out, in place
        if k == "pallas" and not snapshot:
            verify_p = _primitives(
                jax.make_jaxpr(lambda *a, r=runner: r._verify(*a, snapshot=False))(
                    *args, scratch
                ).jaxpr,
                [],
            )
            commit_p = _primitives(
                jax.make_jaxpr(runner._commit)(
                    mm.arena.buffer, runner.table(), *cache_rows, scratch, path, path_len
                ).jaxpr,
                [],
            )
            for prims in (verify_p, commit_p):
                assert not [
                    e
                    for p, e in prims
                    if p == "gather" and e.params["slice_sizes"][-1] == sp.state_words
                ]
                assert not [
                    e
                    for p, e in prims
                    if p == "scatter" and e.invars[2].aval.shape[-1] == sp.state_words
                ]
            names = lambda ps: sorted(e.params["name"] for p, e in ps if p == "pallas_call")  # noqa: E731
            assert names(commit_p) == ["gdn_tree_commit_arena"] * sp.gdn_layers
            assert names(verify_p).count("gdn_tree_verify_arena") == sp.gdn_layers
    for rid in rows:
        mm.free(rid)


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_tree_logits_is_verify_logits_arena_only_read(kernels, llms):
    """How a draft model drafts (``ArenaRunner.tree_logits``): the transient verify's logits,
    from a program that returns nothing else, and the arena unchanged (not donated)."""
    llm = llms["wy", kernels]
    mm, runner = llm.manager, llm.runner
    rows, (handles, pages, lens), tokens, parents, *_ = _batch(llm, "wy", seed=7)
    try:
        before = np.asarray(mm.arena.buffer).copy()
        want = np.asarray(runner.verify(handles, pages, lens, tokens, parents)[0])
        got = runner.tree_logits(handles, pages, lens, tokens, parents)
        assert isinstance(got, jax.Array) and got.dtype == np.float32
        assert got.shape == want.shape == (4, SPECS["wy"].num_nodes, VOCAB)
        np.testing.assert_allclose(np.asarray(got)[:2], want[:2], rtol=1e-5, atol=1e-5)
        assert not mm.arena.buffer.is_deleted()
        np.testing.assert_array_equal(np.asarray(mm.arena.buffer), before)
    finally:
        for rid in rows:
            mm.free(rid)


def test_snapshot_verify_holds_one_layers_states():
    """The snapshot verify into the arena keeps one GDN layer's per-node states alive at a
    time (each layer's written as verified, its state buffer started from the layer's input),
    not every layer's: its scratch memory grows by less than one layer's states when four GDN
    layers are added."""
    from gdn_jax.models.config import FULL, LINEAR
    from tests.serving.conftest import tiny_config

    b, hv, dk = 4, 8, 64
    spec = SpecConfig(method="ngram", tree=(2, 2), verify="snapshot")
    n = spec.num_nodes
    temps = []
    for gdn_layers in (2, 6):
        cfg = tiny_config(
            num_hidden_layers=gdn_layers + 1,
            layer_types=(LINEAR,) * gdn_layers + (FULL,),
            linear_num_value_heads=hv,
            linear_key_head_dim=dk,
            linear_value_head_dim=dk,
            mtp_num_hidden_layers=0,
        )
        geom = dict(GEOM, memory_budget=32 << 20)
        llm = LLM(cfg, load_format="dummy", speculative=spec, **geom)
        r = llm.runner
        i32 = np.int32
        args = (
            r._state, r._buf, r.table(), np.full(b, -1, i32),
            np.full((b, llm.scheduler.pages_per_seq), -1, i32), np.zeros(b, i32),
            np.zeros((b, n), i32), np.tile(np.array([-1, 0, 0, 1, 1, 2, 2], i32), (b, 1)),
            np.full((b, n), -1, i32),
        )  # fmt: skip
        compiled = r._verify.traced.lower(*args, snapshot=True).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    layer_states = b * n * hv * dk * dk * 4
    assert temps[1] - temps[0] < layer_states, (temps, layer_states)
