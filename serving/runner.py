"""Device side of the engine: one model's cache storage and its jitted step functions.

Two storages, one set of step functions (:mod:`gdn_jax.models.steps`):

- :class:`ArenaRunner` (the engine's default for the target model): the cache lives only in
  the memory manager's arena (``MemoryManager.arena.buffer``, donated to every step so it is
  updated in place), addressed by the requests' ``state`` and ``kv`` handles through the
  manager's device handle table (:class:`serving.arena_cache.ArenaCache`); the draft
  tree's state between verify and commit goes into the requests' ``stash`` / ``snapshot``
  units the same way (:meth:`ArenaRunner.verify`). Migrations and compactions move units and
  update the table; the next step reads the new table.
  A draft model's runner (``draft=True``) reads and writes its ``draft_*`` fields of the
  same units through the same handles.
- :class:`ModelRunner`: its own pools (``cache="pools"``, for the target and the draft model).

The pools are a :class:`ModelCache` whose batch axis is the *state-slot* axis (``num_slots``
slots plus one scratch slot that padded rows read and write) and whose KV pages are indexed by
page ids. Every step gathers the rows it serves by slot id, runs a step function of
:mod:`gdn_jax.models.steps` on a bucketed batch, and scatters the rows back, the pools donated.
Shapes depend only on the batch bucket, the prefill chunk and the tree size, so a steady state
compiles nothing (``compiled()`` counts the programs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models import steps
from gdn_jax.models.cache import ModelCache, TreeState, init_cache
from gdn_jax.models.model import HybridLM
from serving import launch
from serving.arena_cache import ArenaCache
from serving.arena_spec import ArenaSpec
from serving.kernels import XLA_KERNELS, ArenaKernels, model_impl, select_kernels
from serving.memory import MemoryManager


@jax.tree_util.register_pytree_node_class
class FlatState:
    """A model's NNX state as its flat leaves and tree structure, for the jitted programs'
    arguments: flattening it at each call is one tuple, where flattening the ``nnx.State``
    calls Python once per variable (about 2 ms a step for a 40-layer model on the host)."""

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, tuple(leaves)

    @classmethod
    def of(cls, state) -> FlatState:
        leaves, treedef = jax.tree.flatten(state)
        return cls(treedef, leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(treedef, leaves)

    def state(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


def _merge(graphdef, state: FlatState) -> HybridLM:
    """The model inside a program, from its :class:`FlatState` argument."""
    return nnx.merge(graphdef, state.state())


def _rows(pool: ModelCache, slots, page_table, lengths, *, fresh: bool = False) -> ModelCache:
    """The rows of ``slots``; with ``fresh``, rows at length 0 start from zero states (a slot
    keeps its last request's state until overwritten)."""
    conv, ssm = pool.conv[:, slots], pool.ssm[:, slots]
    if fresh:
        keep = lengths > 0
        conv = jnp.where(keep[None, :, None, None], conv, 0)
        ssm = jnp.where(keep[None, :, None, None, None], ssm, 0)
    return ModelCache(conv, ssm, pool.k_pages, pool.v_pages, page_table, lengths)


def _store(pool: ModelCache, slots, cache: ModelCache) -> ModelCache:
    return dataclasses.replace(
        pool,
        conv=pool.conv.at[:, slots].set(cache.conv),
        ssm=pool.ssm.at[:, slots].set(cache.ssm),
        k_pages=cache.k_pages,
        v_pages=cache.v_pages,
    )


@functools.cache
def _programs(graphdef):
    """The jitted step functions of one model structure, shared by every runner of it (so a
    second engine over the same model compiles nothing new)."""

    def prefill(state, pool, slots, table, lengths, tokens, num_tokens):
        m = _merge(graphdef, state)
        logits, cache, hidden = steps.prefill(
            m,
            tokens,
            _rows(pool, slots, table, lengths, fresh=True),
            num_tokens,
            return_hidden=True,
        )
        logits = logits.astype(jnp.float32)
        return logits, jnp.argmax(logits, -1), hidden, _store(pool, slots, cache)

    def decode(state, pool, slots, table, lengths, tokens):
        m = _merge(graphdef, state)
        cache = _rows(pool, slots, table, lengths)
        logits, cache, hidden = steps.prefill(
            m, tokens[:, None], cache, jnp.ones_like(lengths), return_hidden=True
        )
        logits = logits.astype(jnp.float32)
        return logits, jnp.argmax(logits, -1), hidden, _store(pool, slots, cache)

    def verify(state, pool, slots, table, lengths, tokens, parents, *, snapshot):
        m = _merge(graphdef, state)
        cache = _rows(pool, slots, table, lengths)
        logits, tree, hidden = steps.verify_tree(
            m, tokens, parents, cache, return_hidden=True, snapshot=snapshot
        )
        logits = logits.astype(jnp.float32)
        return logits, jnp.argmax(logits, -1), hidden, tree

    def commit(pool, slots, table, lengths, tree, path, path_len):
        cache = _rows(pool, slots, table, lengths)
        return _store(pool, slots, steps.commit(cache, tree, path, path_len))

    def tree_logits(state, pool, slots, table, lengths, tokens, parents):
        return verify(state, pool, slots, table, lengths, tokens, parents, snapshot=False)[0]

    prefill_j = jax.jit(prefill, donate_argnums=1)
    decode_j = jax.jit(decode, donate_argnums=1)
    verify_j = jax.jit(verify, static_argnames="snapshot")
    commit_j = jax.jit(commit, donate_argnums=0)
    return prefill_j, decode_j, verify_j, commit_j, jax.jit(tree_logits)


class ModelRunner:
    """Pools and jitted steps of one model (target or drafter). Rows are addressed by dense
    slot ids and page ids of its own pools.

    Args:
      model: the :class:`HybridLM`.
      num_slots: state slots (most requests at once).
      num_pages: KV pages in the pool.
      page_size, pages_per_seq: page geometry; ``pages_per_seq`` is the page-table width.
    """

    def __init__(
        self, model: HybridLM, *, num_slots: int, num_pages: int, page_size: int, pages_per_seq: int
    ):
        self.kind = "pools"
        self.model = model
        self.config = model.config
        self.scratch = num_slots
        self.pages_per_seq = pages_per_seq
        dtype = model.embed_tokens[...].dtype
        self.pool = init_cache(
            self.config,
            num_slots + 1,
            max_len=page_size,
            page_size=page_size,
            num_pages=num_pages,
            page_table=np.zeros((1, 1), np.int32),
            dtype=dtype,
        )
        graphdef, state = nnx.split(model)
        self._state = FlatState.of(state)
        programs = _programs(graphdef)
        self._prefill, self._decode, self._verify, self._commit, self._tree_logits = programs

    def compiled(self) -> int:
        """Programs compiled so far by this runner's step functions."""
        return sum(
            f._cache_size()
            for f in (self._prefill, self._decode, self._verify, self._commit, self._tree_logits)
        )

    def prefill(self, slots, table, lengths, tokens, num_tokens):
        """``tokens [B, C]`` (first ``num_tokens[b]`` real) appended to each row:
        ``(logits [B, V], argmax [B], hidden [B, H])`` at each row's last new token."""
        logits, am, hidden, self.pool = self._prefill(
            self._state, self.pool, slots, table, lengths, tokens, num_tokens
        )
        return logits, am, hidden

    def decode(self, slots, table, lengths, tokens):
        logits, am, hidden, self.pool = self._decode(
            self._state, self.pool, slots, table, lengths, tokens
        )
        return logits, am, hidden

    def verify(self, slots, table, lengths, tokens, parents, *, snapshot: bool = False):
        """``(logits [B, N, V], argmax [B, N], hidden [B, N, H], tree state)``; pools unchanged."""
        return self._verify(
            self._state, self.pool, slots, table, lengths, tokens, parents, snapshot=snapshot
        )

    def tree_logits(self, slots, table, lengths, tokens, parents):
        """``logits [B, N, V]`` of :meth:`verify` alone, for drafting: one program that returns
        nothing else, so no tree state, hidden state or argmax is written out."""
        return self._tree_logits(self._state, self.pool, slots, table, lengths, tokens, parents)

    def commit(self, slots, table, lengths, tree, path, path_len):
        """Accepts ``path[b, :path_len[b]]`` of the verified tree (either verify method)."""
        self.pool = self._commit(self.pool, slots, table, lengths, tree, path, path_len)


# Handle-table changes a step takes with its packed inputs (ArenaRunner.table_delta; more
# changes than this: the table is uploaded whole before the step).
TABLE_DELTA_ROWS = 32


def pack_columns(b: int, *arrays, dtype=np.int32) -> np.ndarray:
    """Host arrays of ``b`` rows each (``[B]`` or ``[B, ...]``) side by side as one ``[B, W]``
    array of ``dtype``: a step's per-row inputs moved to the device as one buffer."""
    return np.concatenate(
        [np.asarray(x).reshape(b, -1).astype(dtype, copy=False) for x in arrays], axis=1
    )


def with_table_delta(ints: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """A step's packed ``int32 [B, W]`` rows with the table delta's ``[R, 3]`` rows appended,
    zero-padded to ``W`` columns: ``[B + R, W]`` (:func:`split_table_delta` inside the step)."""
    tail = np.zeros((delta.shape[0], ints.shape[1]), np.int32)
    tail[:, :3] = delta
    return np.concatenate([ints, tail])


def split_table_delta(table: jax.Array, ints: jax.Array, rows: int):
    """Inside a step: ``(the first B rows of ints, table)`` with the last ``rows`` rows of
    ``ints`` (``(handle, segment, word)``; handle out of range: padding) applied to the table,
    which the step donates and returns, so it is updated in place."""
    b = ints.shape[0] - rows
    delta = ints[b:]
    return ints[:b], table.at[delta[:, 0]].set(delta[:, 1:3], mode="drop")


@functools.cache
def _packed_decode(program: launch.ByTokens, rows: int) -> launch.ByTokens:
    """``program`` (the arena decode: ``(state, buf, table, handles, pages, lengths, tokens)``)
    on packed inputs: ``int32 [B + rows, 3 + MP]`` = handles, page table, lengths, tokens per
    row, then the table delta (:func:`with_table_delta`); returns the decode's outputs, the
    arena and the table (both donated)."""

    def packed(state, buf, table, ints):
        ints, table = split_table_delta(table, ints, rows)
        mp = ints.shape[1] - 3
        handles, pages, lengths, tokens = (
            ints[:, 0],
            ints[:, 1 : 1 + mp],
            ints[:, 1 + mp],
            ints[:, 2 + mp],
        )
        logits, am, hidden, buf = program.fn(state, buf, table, handles, pages, lengths, tokens)
        return logits, am, hidden, buf, table

    def tokens(args):  # one token a row
        return args[3].shape[0] - rows

    return launch.ByTokens(packed, program.graph_tokens, 3, count=tokens, donate_argnums=(1, 2))


# GatedDeltaNet.tree verifies with use_qk_l2norm=True (the TreeCache's static flag, which the
# arena's stash does not store)
_TREE_QK_L2NORM = True


def snapshot_sink(cache, scratch, snapshot: bool):
    """``verify_tree``'s ``snapshot_sink`` for a snapshot verify into the arena: each layer's
    states written into the rows' snapshot units (``scratch``) as verified
    (``ArenaCache.write_snapshot_states``); None otherwise."""
    if snapshot and scratch is not None and hasattr(cache, "write_snapshot_states"):
        return lambda c, layer, states: c.write_snapshot_states(layer, states, scratch)
    return None


@functools.cache
def _arena_programs(
    graphdef,
    spec: ArenaSpec,
    kernels: ArenaKernels = XLA_KERNELS,
    commit_impl: str = "auto",
    make_cache=ArenaCache,
    graph_tokens: int | None = launch.DEFAULT_GRAPH_TOKENS,
):
    """The step functions over the arena: ``buf`` is donated and returned updated (prefill,
    decode, verify, commit). ``kernels`` picks XLA or the in-place Pallas kernels for verify
    and commit (a commit not done in place runs :func:`gdn_jax.tree_commit` with
    ``commit_impl``), and for decode's GDN layers when ``kernels.decode``
    (:func:`_arena_decode_program`); prefill and decode take the attention kernel when
    ``kernels.attention`` (their GDN layers stay on XLA windows unless ``kernels.decode`` /
    ``kernels.prefill``), so those programs are shared by every ``kernels`` choice with the
    same attention choice (:func:`_arena_sequence_programs`).

    ``verify`` with ``scratch`` handles (``int32 [B]`` stash or ``[B, N]`` snapshot units)
    writes the tree state into those units (:meth:`ArenaCache.write_tree_state`) and returns
    the arena; ``commit`` given those handles in place of a tree state reads it back from them
    (:meth:`ArenaCache.read_tree_state`). Without ``scratch``, ``verify`` returns the tree
    state as a transient device value (and not the arena: run it undonated, the fifth program)
    and ``commit`` takes it: the reference path for tests and tools.

    ``make_cache``: builds the programs' cache from ``(buf, table, handles, pages, lengths, spec,
    kernels)``: :class:`ArenaCache`, or a multi-device placement
    (:class:`serving.parallel.Placement`, whose arena has one slice per device).

    ``graph_tokens``: steps of at most this many tokens run as CUDA graphs, larger ones launch
    their kernels one by one (``None``: every step a graph; :mod:`serving.launch`); the commit
    always runs as a graph."""

    def cache_of(buf, table, handles, pages, lengths):
        # every read before every write (ArenaCache.flush): no copy of the arena
        return make_cache(buf, table, handles, pages, lengths, spec, kernels, defer=True)

    def verify(
        state, buf, table, handles, pages, lengths, tokens, parents, scratch=None, *, snapshot
    ):
        m = _merge(graphdef, state)
        cache = cache_of(buf, table, handles, pages, lengths)
        if scratch is not None and scratch.ndim != (2 if snapshot else 1):
            raise ValueError(
                f"verify(snapshot={snapshot}): scratch handles must be int32 "
                f"{'[B, N] snapshot' if snapshot else '[B] stash'} units, got {scratch.shape}"
            )
        sink = snapshot_sink(cache, scratch, snapshot)
        logits, tree, hidden, *written = steps.verify_tree(
            m, tokens, parents, cache, return_hidden=True, snapshot=snapshot, snapshot_sink=sink
        )
        cache = written[0] if written else cache
        logits = logits.astype(jnp.float32)
        if scratch is None:
            return logits, jnp.argmax(logits, -1), hidden, tree
        written, (logits, hidden) = cache.write_tree_state(tree, scratch).flush(logits, hidden)
        return logits, jnp.argmax(logits, -1), hidden, written.buffer

    def commit(buf, table, handles, pages, lengths, tree, path, path_len):
        cache = cache_of(buf, table, handles, pages, lengths)
        if not isinstance(tree, TreeState):  # the scratch handles: the tree is in the arena
            tree = cache.read_tree_state(tree, path, path_len, qk_l2norm=_TREE_QK_L2NORM)
        return steps.commit(cache, tree, path, path_len, impl=commit_impl).flush().buffer

    def tree_logits(state, buf, table, handles, pages, lengths, tokens, parents):
        out = verify(state, buf, table, handles, pages, lengths, tokens, parents, snapshot=False)
        return out[0]

    gt = graph_tokens
    prefill, decode = _arena_sequence_programs(
        graphdef, spec, _attention_only(kernels), make_cache, gt
    )
    if kernels.decode:
        decode = _arena_decode_program(graphdef, spec, kernels, make_cache, gt)
    if kernels.prefill:  # prefill's GDN layers by the in-place arena prefill kernel too
        prefill = _arena_sequence_programs(graphdef, spec, kernels, make_cache, gt)[0]
    # tokens are positional argument 6 of verify and tree_logits
    return (
        prefill,
        decode,
        launch.ByTokens(verify, gt, 6, donate_argnums=1, static_argnames="snapshot"),
        launch.jit(commit, donate_argnums=0),
        # transient: no scratch, arena only read
        launch.ByTokens(verify, gt, 6, static_argnames="snapshot"),
        launch.ByTokens(tree_logits, gt, 6),  # drafting: logits alone, arena only read
    )


def _attention_only(kernels: ArenaKernels) -> ArenaKernels:
    """The part of ``kernels`` that prefill (and the XLA-GDN decode) use: the paged attention
    kernel (:func:`pallas_kernels.attention.arena.paged_attention`, or on the TPU kernels
    :func:`pallas_kernels.tpu.paged_attention_arena`) or none."""
    if kernels.tpu_attention:
        return ArenaKernels(tpu_attention=True, interpret=kernels.interpret)
    if not kernels.attention:
        return XLA_KERNELS
    return ArenaKernels(attention=True, interpret=kernels.interpret, strict=kernels.strict)


@functools.cache
def _arena_sequence_programs(
    graphdef,
    spec: ArenaSpec,
    kernels: ArenaKernels = XLA_KERNELS,
    make_cache=ArenaCache,
    graph_tokens: int | None = launch.DEFAULT_GRAPH_TOKENS,
):
    """Prefill and decode over the arena (``buf`` donated and returned): XLA windows, the
    attention layers by the in-place paged attention kernel when ``kernels.attention`` (the
    TPU one when ``kernels.tpu_attention``)."""

    def cache_of(buf, table, handles, pages, lengths):
        return make_cache(buf, table, handles, pages, lengths, spec, kernels)

    def prefill(state, buf, table, handles, pages, lengths, tokens, num_tokens):
        m = _merge(graphdef, state)
        logits, cache, hidden = steps.prefill(
            m,
            tokens,
            cache_of(buf, table, handles, pages, lengths),
            num_tokens,
            return_hidden=True,
        )
        logits = logits.astype(jnp.float32)
        return logits, jnp.argmax(logits, -1), hidden, cache.buffer

    decode = _arena_decode_program(graphdef, spec, kernels, make_cache, graph_tokens)
    return launch.ByTokens(prefill, graph_tokens, 6, donate_argnums=1), decode


@functools.cache
def _arena_decode_program(
    graphdef,
    spec: ArenaSpec,
    kernels: ArenaKernels,
    make_cache=ArenaCache,
    graph_tokens: int | None = launch.DEFAULT_GRAPH_TOKENS,
):
    """Decode over the arena (``buf`` donated and returned): one token through
    :func:`gdn_jax.models.steps.prefill`; with ``kernels.decode`` its GDN layers run the conv
    (:func:`pallas_kernels.decode.conv.conv_step`) and the step
    (:func:`pallas_kernels.decode.arena.recurrent_step_mixed`) on their states in place
    (``ArenaCache.gdn_step_rule``), else XLA state windows; with ``kernels.attention`` its
    attention layers read the KV pages in place (``ArenaCache.attention``)."""

    def decode(state, buf, table, handles, pages, lengths, tokens):
        m = _merge(graphdef, state)
        logits, cache, hidden = steps.prefill(
            m,
            tokens[:, None],
            make_cache(buf, table, handles, pages, lengths, spec, kernels),
            jnp.ones_like(lengths),
            return_hidden=True,
        )
        logits = logits.astype(jnp.float32)
        return logits, jnp.argmax(logits, -1), hidden, cache.buffer

    return launch.ByTokens(decode, graph_tokens, 6, donate_argnums=1)


class ArenaRunner:
    """Jitted steps of one model whose cache lives only in ``manager``'s arena.

    Rows are addressed by handles: ``handles int32 [B]`` (each row's ``state`` handle, ``-1``
    for padding) and ``pages int32 [B, MP]`` (its ``kv`` handles in token order, ``-1``
    unmapped). The manager must use ``layout_for(model config, page_size)`` (checked). The
    device handle table stays in one buffer: :meth:`decode` and the speculative step take the
    rows changed since the last step with their packed inputs and update it in place (up to
    ``TABLE_DELTA_ROWS``); other steps have it re-uploaded into the buffer when the layout
    changed (``table_uploads`` counts whole uploads).

    ``kernels``: how :meth:`verify` and :meth:`commit` touch the arena
    (:func:`serving.kernels.select_kernels`):

    - ``"xla"``: XLA windows (gathers of each GDN layer's state window and of each attention
      layer's pages; scatters of the committed states);
    - ``"pallas"``: the Pallas kernels read the arena in place through the handle table: the
      GDN tree verify (:func:`pallas_kernels.verify.arena.tree_verify`), the tree attention
      over the KV pages (:func:`pallas_kernels.attention.arena.tree_attention`; prefill's and
      decode's causal attention by :func:`pallas_kernels.attention.arena.paged_attention`),
      the GDN commit (:func:`pallas_kernels.commit.arena.tree_commit`, the arena aliased, so
      in place) and :meth:`decode`'s GDN layers (the conv by
      :func:`pallas_kernels.decode.conv.conv_step` and the step by
      :func:`pallas_kernels.decode.arena.recurrent_step_mixed`, in place); in interpret mode off
      GPU. A geometry the kernels do not take (``page_size`` not a multiple of 16,
      ``head_dim`` not a power of two >= 16, GDN head dims not a power of two in [16, 256], a
      non-f32 recurrent state) raises ``ValueError`` here, a tree of more than ``pallas_kernels.MAX_NODES`` nodes when
      verified;
    - ``"auto"`` (default): ``"pallas"`` on a GPU backend for the parts whose geometry fits
      (and trees of at most 64 nodes), XLA otherwise; ``kernel_notes`` says why a part stayed
      on XLA. Decode's GDN layers take the decode kernel too (measured 1.6-2.8x faster than
      XLA's state windows on the H200, ``benchmarks/arena_read.py``); its attention layers take
      the paged attention kernel as prefill's do.

    :meth:`prefill`'s GDN layers read and write the states in place
    (:func:`pallas_kernels.decode.arena.recurrent_prefill`, a sequential scan) only with
    ``"pallas"``: on the H200 it takes 1.38-1.97x the time of the windows + chunked prefill at
    the default 64-token chunk (0.82-0.87x at 16; ``benchmarks/arena_read.py --step
    prefill``), so ``"auto"`` keeps those. Not wired to the kernels on any setting: the
    snapshot verify method, the conv state outside decode (a small ``(W-1) x C`` window per
    layer), the K/V
    writes (new tokens', accepted nodes') and the speculative scratch's writes and reads (one
    window per stash field; the commit kernel gets the stash's ``k, u, g`` read out by XLA
    windows).

    The speculative scratch lives in the arena (:meth:`verify`): the tree state goes into the
    rows' ``stash`` / ``snapshot`` units, and :meth:`commit` reads it from there.

    ``draft=True``: the runner of a draft model whose cache shares the target's units (the
    ``draft_*`` fields of ``manager.layout.draft``), addressed by the target's own handles;
    it drafts with :meth:`tree_logits` (the arena only read) and catches up with
    :meth:`prefill`.

    ``graph_tokens``: steps of at most this many tokens (rows x tokens per row) run as CUDA
    graphs on a GPU, larger ones launch their kernels one by one (``None``: every step a graph;
    :mod:`serving.launch`).

    ``placement``: a :class:`serving.parallel.Placement` when the model is split over several
    devices: the manager's layout is then one device's share (``placement.local_config``),
    its arena one slice per device, and the programs' cache the placement's
    (:class:`serving.parallel.ShardedArenaCache`, every access per device under
    ``shard_map``).
    """

    def __init__(
        self,
        model: HybridLM,
        manager: MemoryManager,
        *,
        kernels: str = "auto",
        draft: bool = False,
        placement=None,
        graph_tokens: int | None = launch.DEFAULT_GRAPH_TOKENS,
    ):
        self.kind = "arena"
        self.graph_tokens = graph_tokens
        self.model = model
        self.config = model.config
        self.manager = manager
        self.draft = draft
        # on several devices (serving.parallel.Placement) the layout is one device's share
        config = model.config if placement is None else placement.local_config(model.config)
        self.spec = ArenaSpec.from_layout(
            manager.layout, model.embed_tokens[...].dtype, config=config, draft=draft
        )
        self.kernel_choice, self.kernel_notes = select_kernels(
            kernels, self.spec, config, unit_align_words=getattr(manager, "unit_align_words", 1)
        )
        self.kernels = self.kernel_choice.name  # "xla" or "pallas", as resolved
        self.commit_impl = model_impl(kernels)
        graphdef, state = nnx.split(model)
        self._state = FlatState.of(state)
        self.graphdef = graphdef
        # builds the step programs' cache (a serving.parallel.Placement on several devices)
        self.make_cache = ArenaCache if placement is None else placement
        (
            self._prefill,
            self._decode,
            self._verify,
            self._commit,
            self._verify_transient,
            self._tree_logits,
        ) = _arena_programs(
            graphdef,
            self.spec,
            self.kernel_choice,
            model_impl(kernels),
            self.make_cache,
            graph_tokens,
        )
        # the engine's decode: host inputs packed in one array with the table's changes
        self._decode_packed = _packed_decode(self._decode, TABLE_DELTA_ROWS)
        self._table = None
        self.table_uploads = 0

    def compiled(self) -> int:
        return sum(
            f._cache_size()
            for f in (
                self._prefill,
                self._decode,
                self._decode_packed,
                self._verify,
                self._commit,
                self._verify_transient,
                self._tree_logits,
            )
        )

    def table(self) -> jax.Array:
        """The manager's device table (uploaded by the manager only when it changed)."""
        t = self.manager.device_table()
        if t is not self._table:
            self._table = t
            self.table_uploads += 1
        return t

    def table_delta(self, rows: int) -> tuple[jax.Array, np.ndarray]:
        """``(device table, delta int32 [rows, 3])`` for a step program that applies the
        layout's changes itself (:meth:`MemoryManager.device_delta`); hand the table it
        returns to :meth:`adopt_table`."""
        t, delta = self.manager.device_delta(rows)
        if t is not self._table:  # uploaded whole (as in table())
            self._table = t
            self.table_uploads += 1
        return t, delta

    def adopt_table(self, table: jax.Array) -> None:
        self.manager.adopt_table(table)
        self._table = table

    @property
    def _buf(self) -> jax.Array:
        return self.manager.arena.buffer

    @_buf.setter
    def _buf(self, value: jax.Array) -> None:
        self.manager.arena.buffer = value

    def prefill(self, handles, pages, lengths, tokens, num_tokens):
        table = self.table()
        logits, am, hidden, self._buf = self._prefill(
            self._state, self._buf, table, handles, pages, lengths, tokens, num_tokens
        )
        return logits, am, hidden

    def decode(self, handles, pages, lengths, tokens):
        """``(logits [B, V], argmax [B], hidden [B, H])`` of one token per row. Host inputs go
        to the device packed in one array with the handle table's changes (applied in place
        by the step: no separate upload); device ``tokens`` (a previous step's argmax, fed
        back) take the unpacked program."""
        if isinstance(tokens, jax.Array):
            table = self.table()
            logits, am, hidden, self._buf = self._decode(
                self._state, self._buf, table, handles, pages, lengths, tokens
            )
            return logits, am, hidden
        table, delta = self.table_delta(TABLE_DELTA_ROWS)
        ints = pack_columns(np.shape(tokens)[0], handles, pages, lengths, tokens)
        logits, am, hidden, self._buf, table = self._decode_packed(
            self._state, self._buf, table, with_table_delta(ints, delta)
        )
        self.adopt_table(table)
        return logits, am, hidden

    def verify(
        self, handles, pages, lengths, tokens, parents, *, snapshot: bool = False, scratch=None
    ):
        """``(logits [B, N, V], argmax [B, N], hidden [B, N, H], tree)`` for :meth:`commit`.

        The tree state (the speculative scratch) lives in the arena: ``scratch`` holds each
        row's scratch handles, ``int32 [B]`` (its ``stash`` unit; tree WY) or ``int32 [B, N]``
        (its ``N`` ``snapshot`` units; ``snapshot=True``), ``-1`` for padding rows (nothing
        written). Verify writes the tree state into those units through the donated arena, in
        place (:meth:`ArenaCache.write_tree_state`: stash fields ``u, k, g, x, dk, dv``; per
        snapshot node its states, pre-conv inputs and draft K/V), and returns ``scratch`` as
        ``tree``: :meth:`commit` reads the tree state back from the units (on the kernel path
        the GDN commit kernel gets the stash's ``k, u, g`` read out by XLA windows). So no
        device buffer but the arena outlives the step. The units must stay allocated and
        unmoved (no allocation) between the two calls; the engine allocates them at admission
        (:class:`serving.scheduler.Scheduler`).

        Without ``scratch`` (tests, tools): the arena is only read, and ``tree`` is the
        :class:`gdn_jax.models.cache.TreeState` as a transient device value outside the arena
        until :meth:`commit` consumes it (the reference the in-arena path is checked
        against)."""
        args = (self._state, self._buf, self.table(), handles, pages, lengths, tokens, parents)
        if scratch is None:
            return self._verify_transient(*args, snapshot=snapshot)
        scratch = np.asarray(scratch, np.int32)
        logits, am, hidden, self._buf = self._verify(*args, scratch, snapshot=snapshot)
        return logits, am, hidden, scratch

    def tree_logits(self, handles, pages, lengths, tokens, parents):
        """``logits [B, N, V]`` of :meth:`verify` (tree WY) alone, the arena only read: how a
        draft model drafts (one program that returns nothing else, so no transient tree
        state, hidden state or argmax is written out)."""
        return self._tree_logits(
            self._state, self._buf, self.table(), handles, pages, lengths, tokens, parents
        )

    def commit(self, handles, pages, lengths, tree, path, path_len):
        """Accepts ``path[b, :path_len[b]]``: ``tree`` is what :meth:`verify` returned (the
        scratch handles, or the transient tree state)."""
        table = self.table()
        self._buf = self._commit(self._buf, table, handles, pages, lengths, tree, path, path_len)


@functools.cache
def _mtp_fn(graphdef):
    def run(state, hidden, tokens):
        m = _merge(graphdef, state)
        h = m.mtp(m.embed(tokens[:, None]), hidden[:, None])
        logits = m.logits(h[:, 0]).astype(jnp.float32)
        return logits, h[:, 0]

    return jax.jit(run)


class MTPRunner:
    """The target's MTP head on independent positions: ``(hidden [F, H], tokens [F]) ->
    (logits [F, V], hidden [F, H])``."""

    def __init__(self, model: HybridLM):
        if model.mtp is None:
            raise ValueError("speculative: method='mtp' needs a model with an MTP head")
        graphdef, state = nnx.split(model)
        self._state = FlatState.of(state)
        self._fn = _mtp_fn(graphdef)

    def compiled(self) -> int:
        return self._fn._cache_size()

    def __call__(self, hidden, tokens):
        return self._fn(self._state, hidden, tokens)
