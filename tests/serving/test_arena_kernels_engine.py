"""The arena path's kernel choice (``ArenaRunner(kernels=)``, ``LLM(kernels=)``): tree verify and
commit, decode and prefill by the Pallas kernels that read the arena in place through the handle
table (interpret mode on CPU) give the XLA path's logits, arena contents and greedy tokens, and
their programs hold no gather / scatter of the GDN state windows (verify, commit, decode) or
gather of the KV pages (every attention layer of verify, decode and prefill).

One geometry for the module (page_size 16: the attention kernel needs a multiple of 16; the
same arena size and batch bucket everywhere), so each program compiles once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from serving import LLM, SamplingParams, SpecConfig
from serving.arena_cache import ArenaCache
from serving.kernels import select_kernels
from serving.runner import ArenaRunner
from tests.serving.conftest import ENGINE, VOCAB, host_speculation, prompts

SPEC = SpecConfig(method="ngram", tree=(2, 2))  # N = 7 nodes, depth 2
GEOM = dict(ENGINE, page_size=16, memory_budget=2 << 20)


@pytest.fixture(scope="module")
def llms(target):
    return {k: LLM(target, speculative=SPEC, kernels=k, **GEOM) for k in ("xla", "pallas")}


def _tree_batch(llm, seed=0):
    """Two prefilled rows (lengths 21 and 9: partial pages) and two padding rows, a draft tree
    with a padding node, and accepted paths of 3, 2, 0, 0 nodes."""
    rng = np.random.default_rng(seed)
    mm, runner = llm.manager, llm.runner
    b, mp, n = 4, llm.scheduler.pages_per_seq, SPEC.num_nodes
    handles = np.full(b, -1, np.int32)
    pages = np.full((b, mp), -1, np.int32)
    lens = np.array([21, 9, 0, 0], np.int32)
    for i in range(2):
        handles[i] = mm.alloc(("kern", seed, i), "state")[0]
        pages[i, :2] = mm.alloc(("kern", seed, i), "kv", 2)
    for start in (0, 16):  # prefill in chunks of 16 (the engine's program)
        count = np.clip(lens - start, 0, 16).astype(np.int32)
        tok = rng.integers(0, VOCAB, (b, 16)).astype(np.int32)
        runner.prefill(handles, pages, np.minimum(lens, start).astype(np.int32), tok, count)
    parents = np.tile(np.array([-1, 0, 0, 1, 2, 1, -2], np.int32), (b, 1))
    tokens = rng.integers(0, VOCAB, (b, n)).astype(np.int32)
    path = np.full((b, SPEC.max_depth + 1), -1, np.int32)
    path[0], path[1, :2] = [0, 1, 3], [0, 2]
    path_len = np.array([3, 2, 0, 0], np.int32)
    return handles, pages, lens, tokens, parents, path, path_len


def test_verify_commit_pallas_equals_xla(llms, target):
    llm = llms["xla"]
    mm = llm.manager
    pallas = ArenaRunner(target, mm, kernels="pallas")  # a second runner on the same arena
    assert (llm.runner.kernels, pallas.kernels) == ("xla", "pallas")
    handles, pages, lens, tokens, parents, path, path_len = _tree_batch(llm)
    base = np.asarray(mm.arena.buffer).copy()
    out = {}
    for name, runner in (("xla", llm.runner), ("pallas", pallas)):
        mm.arena.buffer = jax.device_put(base, mm.arena.buffer.device)
        logits, am, _, tree = runner.verify(handles, pages, lens, tokens, parents)
        runner.commit(handles, pages, lens, tree, path, path_len)
        out[name] = np.asarray(logits)[:2], np.asarray(am)[:2], np.asarray(mm.arena.buffer)
    (lx, ax, bx), (lp, ap, bp) = out["xla"], out["pallas"]
    np.testing.assert_allclose(lp, lx, rtol=1e-4, atol=1e-4 * np.abs(lx).max())
    np.testing.assert_array_equal(ap, ax)
    # the rows' state and KV units: equal to f32 rounding (every field is f32 here; the kernels
    # sum in another order, and later layers see those ulps); every other word: bit for bit
    rows = [("kern", 0, 0), ("kern", 0, 1)]
    other = np.ones(base.shape, bool)
    for _, kind, rid, seg, word, words in mm.live():
        if rid not in rows:
            continue
        span = slice(word, word + words)
        other[seg, span] = False
        x, p = bx[seg, span].view(np.float32), bp[seg, span].view(np.float32)
        np.testing.assert_allclose(p, x, rtol=1e-5, atol=1e-5, err_msg=f"{kind} unit")
        if kind == "state":
            assert not np.array_equal(bx[seg, span], base[seg, span])  # the commit wrote it
    np.testing.assert_array_equal(bp[other], bx[other])
    mm.free(rows[0])
    mm.free(rows[1])


def test_unfused_decode_kernels_same_tokens(llms, target):
    """The decode kernels on separate projections (``fuse_projections=False``: the conv and
    step kernels take their own q, k, v and gate arrays) give the tokens of the fused engine,
    whose kernels read those columns of one projection output in place."""
    ps, params = prompts(2, seed=5), SamplingParams(max_tokens=6)
    unfused = LLM(target, kernels="pallas", fuse_projections=False, **GEOM)
    want = [o.token_ids for o in llms["pallas"].generate(ps, params)]
    assert [o.token_ids for o in unfused.generate(ps, params)] == want


@pytest.mark.parametrize("path", ["device", "host"])
def test_greedy_tree_speculation_same_tokens(llms, path):
    """The kernels give the xla path's tokens, with speculation in one device program per step
    and on the host's multi-program path."""
    ps, params = prompts(3, seed=3), SamplingParams(max_tokens=12)
    runner = llms["pallas"].runner
    assert runner.kernels == "pallas"
    verified = []
    compiled = runner._verify._cache_size()  # other modules' engines may share the program
    runner.verify = lambda *a, **k: verified.append(1) or type(runner).verify(runner, *a, **k)
    saved = {k: llm.engine.device_spec for k, llm in llms.items()}
    device_calls = saved["pallas"].calls
    if path == "host":
        for llm in llms.values():
            host_speculation(llm)
    try:
        got = {k: [o.token_ids for o in llm.generate(ps, params)] for k, llm in llms.items()}
    finally:
        del runner.verify
        for k, llm in llms.items():
            llm.engine.device_spec = saved[k]
    assert got["pallas"] == got["xla"]
    assert all(len(t) == 12 for t in got["xla"])
    if path == "device":  # the tokens came from tree speculation on the kernels
        assert not verified and saved["pallas"].calls - device_calls >= 3
        return
    assert len(verified) >= 3
    # the engine's verify (scratch in the arena) compiles at most once for the whole run
    assert runner._verify._cache_size() - compiled <= 1


def _primitives(jaxpr, out):
    """``(primitive name, eqn)`` of every equation, through nested jaxprs but not into a
    ``pallas_call``'s kernel body."""
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, eqn))
        if eqn.primitive.name == "pallas_call":
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, ClosedJaxpr):
                    _primitives(sub.jaxpr, out)
                elif isinstance(sub, Jaxpr):
                    _primitives(sub, out)
    return out


def _programs(runner, args):
    """The primitives of the runner's verify and commit programs on ``args``."""
    handles, pages, lens, tokens, parents, path, path_len = args
    buf, table = runner.manager.arena.buffer, runner.table()
    verify_args = (runner._state, buf, table, handles, pages, lens, tokens, parents)
    verify = jax.make_jaxpr(lambda *a: runner._verify(*a, snapshot=False))(*verify_args)
    tree = jax.eval_shape(lambda *a: runner._verify(*a, snapshot=False), *verify_args)[3]
    commit = jax.make_jaxpr(runner._commit)(buf, table, handles, pages, lens, tree, path, path_len)
    return _primitives(verify.jaxpr, []), _primitives(commit.jaxpr, [])


def _kernel_names(prims):
    return sorted(e.params["name"] for p, e in prims if p == "pallas_call")


def test_pallas_programs_do_not_gather_states_or_pages(llms):
    """XLA's verify gathers each GDN layer's state window and the attention layer's pages, and
    its commit scatters the state windows; with kernels='pallas' none of those ops exist and
    the arena kernels do the work (so this fails if the wiring is removed)."""
    sp = llms["xla"].runner.spec
    lg, la = sp.gdn_layers, sp.attn_layers
    page_words = sp.page_size * sp.token_words
    assert len({sp.state_words, sp.conv_words, page_words, sp.token_words}) == 4

    def gathers(prims, words):
        return sum(p == "gather" and e.params["slice_sizes"][-1] == words for p, e in prims)

    def scatters(prims, words):
        return sum(p == "scatter" and e.invars[2].aval.shape[-1] == words for p, e in prims)

    args = _tree_batch(llms["xla"], seed=1)
    (xv, xc), (pv, pc) = (_programs(llms[k].runner, args) for k in ("xla", "pallas"))
    assert gathers(xv, sp.state_words) == lg and gathers(xv, page_words) == 2 * la
    assert scatters(xc, sp.state_words) == lg
    # (on a GPU the XLA path's gdn_jax ops route to the dense Pallas kernels, never the arena's)
    assert not [k for k in _kernel_names(xv) + _kernel_names(xc) if "arena" in k]
    assert gathers(pv, sp.state_words) == 0 and gathers(pv, page_words) == 0
    assert scatters(pc, sp.state_words) == 0 and gathers(pc, sp.state_words) == 0
    assert _kernel_names(pv) == sorted(
        ["gdn_tree_verify_arena"] * lg + ["tree_attention_arena"] * la
    )
    assert _kernel_names(pc) == ["gdn_tree_commit_arena"] * lg
    for rid in {r for _, _, r, *_ in llms["xla"].manager.live()}:
        llms["xla"].manager.free(rid)


def test_kernel_option_validation(target, llms):
    spec = llms["xla"].runner.spec
    assert select_kernels("auto", spec, backend="cpu")[0].name == "xla"
    auto_gpu, notes = select_kernels("auto", spec, backend="gpu")
    assert (auto_gpu.gdn, auto_gpu.attention, auto_gpu.interpret, notes) == (True, True, False, ())
    assert LLM(target, **GEOM).runner.kernels == (
        "xla" if jax.default_backend() != "gpu" else "pallas"
    )
    with pytest.raises(ValueError, match="kernels"):
        LLM(target, kernels="triton", **GEOM)
    with pytest.raises(ValueError, match="kernels"):
        ArenaRunner(target, llms["xla"].manager, kernels="fast")
    with pytest.raises(ValueError, match="kernels='pallas'.*cache='arena'"):
        LLM(target, kernels="pallas", cache="pools", **GEOM)
    # page_size 8: the attention kernel refuses it; "pallas" says so, "auto" on GPU falls back
    small = LLM(target, **ENGINE).runner.spec
    with pytest.raises(ValueError, match="kernels='pallas': page_size 8"):
        select_kernels("pallas", small)
    part, notes = select_kernels("auto", small, backend="gpu")
    assert part.gdn and not part.attention and "page_size 8" in notes[0]
    # trees past the kernels' limit: "pallas" raises, "auto" leaves them to XLA
    assert not auto_gpu.takes(65, "x")
    with pytest.raises(ValueError, match="at most 128 nodes"):
        select_kernels("pallas", spec)[0].takes(129, "GDN tree verify")
    # the tree attention kernel checks the same limit before it traces anything
    strict = dataclasses.replace(select_kernels("pallas", spec)[0], max_nodes=4)
    cache = ArenaCache(
        jnp.zeros((1, 8), jnp.uint32),
        jnp.zeros((1, 2), jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1,), jnp.int32),
        spec,
        strict,
    )
    d = jnp.zeros((1, 5, spec.kv_heads, spec.head_dim), jnp.float32)
    with pytest.raises(ValueError, match="tree attention kernel takes trees of at most 4"):
        cache.attention(
            0,
            d,
            jnp.ones((1,), jnp.int32),
            jnp.zeros((1, 5), jnp.int32),
            scale=1.0,
            draft_k=d,
            draft_v=d,
            draft_mask=jnp.ones((1, 5, 5), bool),
        )


def _decode_both(xla, pallas, mm, base, handles, pages, lens, tokens, rows):
    """Three greedy decode steps by each runner from the arena ``base``: the first ``rows``
    rows' logits and tokens must agree; returns both final arenas ``(xla, pallas)``."""
    live = (handles >= 0).astype(np.int32)
    out = {}
    for name, runner in (("xla", xla), ("pallas", pallas)):
        mm.arena.buffer = jax.device_put(base, mm.arena.buffer.device)
        lengths, tok, got = lens.copy(), tokens[:, 0].copy(), []
        for _ in range(3):
            logits, am, _ = runner.decode(handles, pages, lengths, tok)
            got.append((np.asarray(logits)[:rows], np.asarray(am)[:rows]))
            lengths, tok = lengths + live, np.asarray(am).astype(np.int32)
        out[name] = got, np.asarray(mm.arena.buffer)
    (gx, bx), (gp, bp) = out["xla"], out["pallas"]
    for (lx, ax), (lp, ap) in zip(gx, gp, strict=True):
        np.testing.assert_allclose(lp, lx, rtol=1e-4, atol=1e-4 * np.abs(lx).max())
        np.testing.assert_array_equal(ap, ax)
    return bx, bp


def test_decode_pallas_equals_xla_without_state_gathers(llms, target):
    """Greedy decode steps with kernels='pallas' (the GDN layers by the in-place arena decode
    kernel, the attention layers by the paged arena attention kernel) give the XLA path's
    logits, tokens and arena; a row at length 0 with a stale unit starts from a zero state on
    both, and a padding row's attention gives 0 on both. The pallas decode program gathers /
    scatters no GDN state window and gathers no KV page ("auto" on GPU takes the decode kernel too)."""
    sp = llms["xla"].runner.spec
    assert select_kernels("pallas", sp)[0].decode
    assert select_kernels("auto", sp, backend="gpu")[0].decode
    assert not select_kernels("auto", sp, backend="cpu")[0].decode
    llm = llms["xla"]
    mm = llm.manager
    pallas = ArenaRunner(target, mm, kernels="pallas")
    handles, pages, lens, tokens, *_ = _tree_batch(llm, seed=2)
    handles[2] = mm.alloc(("kern", 2, 2), "state")[0]  # a fresh row: length 0, stale unit
    pages[2, :1] = mm.alloc(("kern", 2, 2), "kv", 1)
    base = np.asarray(mm.arena.buffer).copy()
    for _, kind, rid, seg, word, words in mm.live():
        if rid == ("kern", 2, 2) and kind == "state":  # stale bits, NaN patterns included
            base[seg, word : word + words] = np.random.default_rng(0).integers(0, 2**32, words)
    bx, bp = _decode_both(llm.runner, pallas, mm, base, handles, pages, lens, tokens, rows=3)
    rows = [("kern", 2, 0), ("kern", 2, 1), ("kern", 2, 2)]
    other = np.ones(base.shape, bool)
    for _, kind, rid, seg, word, words in mm.live():
        if rid in rows:
            span = slice(word, word + words)
            other[seg, span] = False
            x, p = bx[seg, span].view(np.float32), bp[seg, span].view(np.float32)
            np.testing.assert_allclose(p, x, rtol=1e-5, atol=1e-5, err_msg=f"{kind} unit")
            if kind == "state":
                assert not np.array_equal(bp[seg, span], base[seg, span])  # decode wrote it
    np.testing.assert_array_equal(bp[other], bx[other])

    def gathers(prims, words):
        return sum(p == "gather" and e.params["slice_sizes"][-1] == words for p, e in prims)

    def scatters(prims, words):
        return sum(p == "scatter" and e.invars[2].aval.shape[-1] == words for p, e in prims)

    args = (mm.arena.buffer, llm.runner.table(), handles, pages, lens, tokens[:, 0])
    (xd, pd) = (
        _primitives(jax.make_jaxpr(r._decode)(r._state, *args).jaxpr, [])
        for r in (llm.runner, pallas)
    )
    lg, la, page_words = sp.gdn_layers, sp.attn_layers, sp.page_size * sp.token_words
    assert gathers(xd, sp.state_words) == lg and scatters(xd, sp.state_words) == lg
    assert gathers(xd, page_words) == 2 * la
    assert not [k for k in _kernel_names(xd) if "arena" in k]
    assert gathers(pd, sp.state_words) == 0 and scatters(pd, sp.state_words) == 0
    assert gathers(pd, page_words) == 0
    # the GDN layers: the conv on its window in place, then the step on the conv's raw output
    # (channels split and gates formed in the kernel); no conv window gathered or scattered
    assert gathers(xd, sp.conv_words) == lg and scatters(xd, sp.conv_words) == lg
    assert gathers(pd, sp.conv_words) == 0 and scatters(pd, sp.conv_words) == 0
    assert _kernel_names(pd) == sorted(
        ["gdn_conv_step_arena", "gdn_recurrent_step_mixed_arena"] * lg
        + ["paged_attention_arena"] * la
    )
    for rid in rows:
        mm.free(rid)


def test_fused_attention_decode_prep_equals_xla(llms, monkeypatch):
    """With the engine's fused projections (``LLM``'s model) and
    ``serving.kernels.ATTENTION_DECODE_KERNEL`` on (the default), kernels='pallas' runs each
    attention layer's decode step from its projection output by one kernel (q and k head norms,
    partial rope, the token's K/V written into its page in place: ``attention_decode_prep``):
    three greedy steps give the XLA path's logits, tokens and arena, and the program scatters no
    K/V window (a padding row writes nothing). Off, the same runner's program has no such
    kernel. The pallas runner also takes the GDN layers' gated norm inside their step kernel
    (``serving.kernels.DECODE_GATED_NORM``)."""
    from serving import kernels

    assert kernels.ATTENTION_DECODE_KERNEL
    llm = llms["xla"]
    monkeypatch.setattr(kernels, "ATTENTION_DECODE_KERNEL", False)
    off = ArenaRunner(llm.runner.model, llm.manager, kernels="pallas")
    off_args = (llm.manager.arena.buffer, llm.runner.table(), *_tree_batch(llm, seed=5)[:3])
    off_prims = _primitives(
        jax.make_jaxpr(off._decode)(off._state, *off_args, off_args[-1]).jaxpr, []
    )
    assert "attention_decode_prep" not in _kernel_names(off_prims)
    for i in range(2):
        llm.manager.free(("kern", 5, i))
    monkeypatch.setattr(kernels, "ATTENTION_DECODE_KERNEL", True)
    # the GDN layers' gated norm inside their step kernel too (off by default)
    monkeypatch.setattr(kernels, "DECODE_GATED_NORM", True)
    mm = llm.manager
    model = llm.runner.model
    assert model.layers[-1].self_attn.fused_in is not None
    pallas = ArenaRunner(model, mm, kernels="pallas")
    handles, pages, lens, tokens, *_ = _tree_batch(llm, seed=4)
    base = np.asarray(mm.arena.buffer).copy()
    bx, bp = _decode_both(llm.runner, pallas, mm, base, handles, pages, lens, tokens, rows=2)
    changed = bx != base
    assert changed.any()  # the steps wrote states and K/V
    np.testing.assert_allclose(bp.view(np.float32), bx.view(np.float32), rtol=1e-5, atol=1e-5)
    args = (mm.arena.buffer, llm.runner.table(), handles, pages, lens, tokens[:, 0])
    prims = _primitives(jax.make_jaxpr(pallas._decode)(pallas._state, *args).jaxpr, [])
    la = llm.runner.spec.attn_layers
    assert _kernel_names(prims).count("attention_decode_prep") == la
    assert not [p for p, _ in prims if p == "scatter"]
    for i in range(2):
        mm.free(("kern", 4, i))


def test_prefill_pallas_equals_xla_without_page_gathers(llms, target):
    """Chunked prefill with kernels='pallas' (each GDN layer by the in-place arena prefill
    kernel, each attention layer by the paged arena attention kernel, causal over the pages
    written so far) gives the XLA path's logits and arena: two chunks of 16 (the engine's
    program) over rows ending inside a page, a row with no new token in the second chunk, a
    fresh row whose state unit holds stale bits, and a padding row (all four rows' logits
    compared). The pallas prefill program gathers / scatters no GDN state window and gathers no
    KV page (XLA does both per layer); "auto" keeps XLA's chunked GDN prefill."""
    sp = llms["xla"].runner.spec
    assert select_kernels("pallas", sp)[0].prefill
    assert not select_kernels("auto", sp, backend="gpu")[0].prefill
    llm = llms["xla"]
    mm = llm.manager
    pallas = ArenaRunner(target, mm, kernels="pallas")  # a second runner on the same arena
    rng = np.random.default_rng(4)
    b, mp = 4, llm.scheduler.pages_per_seq
    handles = np.full(b, -1, np.int32)
    pages = np.full((b, mp), -1, np.int32)
    lens = np.array([21, 9, 16, 0], np.int32)
    rows = [("kern", 4, i) for i in range(3)]
    for i, rid in enumerate(rows):
        handles[i] = mm.alloc(rid, "state")[0]
        pages[i, :2] = mm.alloc(rid, "kv", 2)
    chunks = [
        (
            np.minimum(lens, start).astype(np.int32),
            rng.integers(0, VOCAB, (b, 16)).astype(np.int32),
            np.clip(lens - start, 0, 16).astype(np.int32),
        )
        for start in (0, 16)
    ]
    base = np.asarray(mm.arena.buffer).copy()
    for _, kind, rid, seg, word, words in mm.live():
        if rid == rows[1] and kind == "state":  # stale bits, NaN patterns included
            base[seg, word : word + words] = np.random.default_rng(1).integers(0, 2**32, words)
    out = {}
    for name, runner in (("xla", llm.runner), ("pallas", pallas)):
        mm.arena.buffer = jax.device_put(base, mm.arena.buffer.device)
        got = []
        for start, tok, count in chunks:
            logits, am, _ = runner.prefill(handles, pages, start, tok, count)
            got.append((np.asarray(logits), np.asarray(am)))
        out[name] = got, np.asarray(mm.arena.buffer)
    (gx, bx), (gp, bp) = out["xla"], out["pallas"]
    for (lx, ax), (lp, ap) in zip(gx, gp, strict=True):
        np.testing.assert_allclose(lp, lx, rtol=1e-4, atol=1e-4 * np.abs(lx).max())
        np.testing.assert_array_equal(ap, ax)
    other = np.ones(base.shape, bool)
    for _, kind, rid, seg, word, words in mm.live():
        if rid in rows:
            span = slice(word, word + words)
            other[seg, span] = False
            x, p = bx[seg, span].view(np.float32), bp[seg, span].view(np.float32)
            # XLA's prefill runs the chunked (WY) rule, the kernel the sequential one: the same
            # math summed in another order, those f32 ulps grown through the layers (measured:
            # |diff| <= 2e-5 on values up to 2.6 on one host, 1.4e-4 at 1.03 on another, whose
            # CPU kernels sum in another order)
            np.testing.assert_allclose(p, x, rtol=1e-5, atol=3e-4, err_msg=f"{kind} unit")
            if kind == "state":
                assert not np.array_equal(bp[seg, span], base[seg, span])  # prefill wrote it
    np.testing.assert_array_equal(bp[other], bx[other])

    page_words = sp.page_size * sp.token_words
    start, tok, count = chunks[1]
    args = (mm.arena.buffer, llm.runner.table(), handles, pages, start, tok, count)
    xp, pp = (
        _primitives(jax.make_jaxpr(r._prefill)(r._state, *args).jaxpr, [])
        for r in (llm.runner, pallas)
    )
    la, lg = sp.attn_layers, sp.gdn_layers

    def gathers(prims, words):
        return sum(p == "gather" and e.params["slice_sizes"][-1] == words for p, e in prims)

    def scatters(prims, words):
        return sum(p == "scatter" and e.invars[2].aval.shape[-1] == words for p, e in prims)

    assert gathers(xp, page_words) == 2 * la and gathers(pp, page_words) == 0
    assert gathers(xp, sp.state_words) == lg and scatters(xp, sp.state_words) == lg
    assert gathers(pp, sp.state_words) == 0 and scatters(pp, sp.state_words) == 0
    # (on GPU the XLA prefill also runs gdn_jax's chunked Pallas prefill: count only the arena's)
    assert not [k for k in _kernel_names(xp) if "arena" in k]
    assert [k for k in _kernel_names(pp) if "arena" in k] == sorted(
        ["gdn_recurrent_prefill_arena"] * lg + ["paged_attention_arena"] * la
    )
    for rid in rows:
        mm.free(rid)


def test_unified_padded_pages_take_the_kernels(target):
    """A padded unified pool's KV pages, enlarged to hold a recurrent state (a multiple of 16
    tokens, not a power of two here), go through the attention kernels too: greedy tokens
    equal the XLA engine's, with and without speculation."""
    kw = dict(GEOM, memory_policy="unified_padded")
    ps, params = prompts(3, seed=5), SamplingParams(max_tokens=12)
    for spec in (None, SPEC):
        xla = LLM(target, kernels="xla", speculative=spec, **kw)
        pal = LLM(target, kernels="pallas", speculative=spec, **kw)
        page = pal.manager.tokens_per_page
        assert page % 16 == 0 and page & (page - 1), page
        assert pal.runner.kernel_choice.attention and pal.runner.spec.page_size == page
        want = [o.token_ids for o in xla.generate(ps, params)]
        assert [o.token_ids for o in pal.generate(ps, params)] == want
