"""Multi-device serving: the engine's parallel configuration and where its arrays live.

``LLM(model, tensor_parallel_size=T, data_parallel_size=D, enable_expert_parallel=E)`` uses
``T * D`` devices as a ``(data, tensor)`` mesh (:func:`gdn_jax.sharding.make_mesh`):

- **data parallelism** is ``D`` independent engine replicas, each over one row of the mesh (its
  own scheduler, memory manager, arena and copy of the weights); :class:`ReplicaScheduler`
  gives each new request to the least loaded replica and :class:`ReplicaEngine` steps the
  replicas in threads. No collective crosses replicas;
- **tensor parallelism** inside a replica is GSPMD over the row's ``tensor`` axis: the model
  view of :func:`gdn_jax.sharding.shard_model` (weights placed with ``NamedSharding`` by
  parameter path), so the engine's jitted step programs partition as they are;
- **expert parallelism** (``enable_expert_parallel``) splits the routed experts over the same
  ``tensor`` axis instead of splitting each expert (EP size = TP size).

One replica's cache lives in a **per-device arena**: a ``uint32 [T, segments, words]`` buffer
whose leading axis is sharded over ``tensor`` (:class:`ShardedArena`), so each device holds
one ``[segments, words]`` arena laid out for its own heads
(``layout_for(gdn_jax.sharding.local_config(...))``). There is **one handle space**: the
memory manager allocates, migrates and compacts units once, and a handle addresses the same
``(segment, word)`` in every device's arena, each unit there holding that device's heads of the
request's GDN states, KV pages and speculative scratch. The device handle table is replicated.

:class:`ShardedArenaCache` is the :class:`gdn_jax.models.StepCache` over that arena: each of
its methods runs the single-device :class:`serving.arena_cache.ArenaCache` on every device's
own arena and heads under ``shard_map`` (global arrays in and out sharded on their head axis).
Its in-place hooks always answer, so every GDN layer's rule (chunked prefill, decode step, tree
WY verify, commit) and every attention layer's paged attention run per device under
``shard_map``, on the Pallas arena kernels where :func:`serving.kernels.select_kernels` picks
them: no communication in verify or commit. A model whose heads do not split over ``T`` (a
small draft model) is replicated instead (``Placement(heads_sharded=False)``): every device
holds its whole cache in its own arena and computes it redundantly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax import TreeCache, chunk_gated_delta_rule, tree_commit, tree_verify
from gdn_jax.models import HybridLM, ModelConfig
from gdn_jax.models.cache import TreeState
from gdn_jax.sharding import (
    TENSOR,
    check_tensor_parallel,
    local_config,
    make_mesh,
    param_spec,
    replicate_model,
    shard_model,
    tensor_parallel_errors,
)
from serving.arena_cache import ArenaCache
from serving.arena_spec import ArenaSpec
from serving.kernels import ArenaKernels
from serving.memory import MemoryManager
from serving.memory.arena import (
    Arena,
    allocate,
    check_arena_size,
    field_to_words,
    move_units,
    scatter_windows,
    words_to_field,
)
from serving.memory.layout import WORD_BYTES, HybridLayout

_R = P()


# ------------------------------------------------------------------------------ configuration


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The engine's parallel layout in vLLM's words (validated; ``ValueError`` names the
    argument).

    ``devices``: the devices to use, ``data_parallel_size * tensor_parallel_size`` of them in
    mesh order (default: the first of ``jax.devices()``, which spans every process after
    ``jax.distributed.initialize``)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    devices: tuple | None = None

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}"
            )
        if self.devices is not None:
            devs = tuple(self.devices)
            if not devs or not all(isinstance(d, jax.Device) for d in devs):
                raise ValueError(f"devices must be a sequence of jax.Device, got {self.devices!r}")
            object.__setattr__(self, "devices", devs)
        self.mesh  # noqa: B018 (checks the device count)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def enabled(self) -> bool:
        """Whether the engine leaves the default single-device path."""
        return self.world_size > 1 or self.devices is not None

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The ``(data, tensor)`` mesh (:func:`gdn_jax.sharding.make_mesh`)."""
        return make_mesh(self.tensor_parallel_size, self.data_parallel_size, self.devices)

    def replica_devices(self) -> list[tuple]:
        """Each data-parallel replica's devices (one row of the mesh)."""
        return [tuple(row) for row in self.mesh.devices]

    def check_model(self, config: ModelConfig) -> None:
        """``ValueError`` naming ``tensor_parallel_size`` / ``enable_expert_parallel`` when the
        model's heads or experts do not split over the tensor axis."""
        check_tensor_parallel(config, self.tensor_parallel_size, self.enable_expert_parallel)

    def check_source(self, model: Any) -> None:
        """:meth:`check_model` on the config of an ``LLM`` model argument before anything is
        loaded, where it can be read (a config, a config dict, a model, a local path)."""
        try:
            if isinstance(model, HybridLM):
                config = model.config
            elif isinstance(model, ModelConfig):
                config = model
            elif isinstance(model, dict):
                config = ModelConfig.from_hf_dict(model)
            else:
                from gdn_jax.models.loading import load_config

                config = load_config(model)
        except Exception:  # the loader reports a bad model argument itself
            return
        self.check_model(config)

    def placement(self, impl: str = "xla") -> Placement:
        """The placement of a single replica (``data_parallel_size == 1``)."""
        if self.data_parallel_size != 1:
            raise ValueError("placement: one per data-parallel replica (replica_devices())")
        row = self.mesh.devices[0]
        mesh = Mesh(np.array(row, dtype=object).reshape(1, -1), self.mesh.axis_names)
        return Placement(mesh, expert_parallel=self.enable_expert_parallel, impl=impl)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one engine replica's model and cache live: ``mesh`` (``(1, T)``, axes
    ``(data, tensor)``). ``heads_sharded``: the model is split by heads over ``tensor``
    (``False``: replicated, e.g. a draft model whose heads do not split). ``impl``: the
    ``impl`` of the GDN ops the arena hooks run on XLA-read states (the engine's
    :func:`serving.kernels.model_impl`). Hashable: a static argument of the step programs,
    which call it to build their cache (:meth:`__call__`)."""

    mesh: Mesh
    expert_parallel: bool = False
    heads_sharded: bool = True
    impl: str = "xla"

    @property
    def tp(self) -> int:
        return self.mesh.shape[TENSOR]

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, _R)

    @property
    def arena_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(TENSOR))

    def for_draft(self, config: ModelConfig) -> Placement:
        """The placement of a draft model on the same devices: split by heads when they split
        over ``tensor`` (no expert parallelism), else replicated."""
        split = not tensor_parallel_errors(config, self.tp, False)
        return dataclasses.replace(self, expert_parallel=False, heads_sharded=split)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """One device's cache geometry (:func:`gdn_jax.sharding.local_config`)."""
        if not self.heads_sharded:
            return config
        return local_config(config, self.tp, expert_parallel=self.expert_parallel)

    def place(self, model: HybridLM) -> HybridLM:
        """The model laid out on the mesh (:func:`gdn_jax.sharding.shard_model` or, with
        ``heads_sharded=False``, replicated)."""
        if self.heads_sharded:
            return shard_model(model, self.mesh, expert_parallel=self.expert_parallel)
        return replicate_model(model, self.mesh)

    def load_sharding(self, path: str, shape: tuple[int, ...]):
        """Where ``from_pretrained`` / ``init_random`` put parameter ``path`` before the view
        is built (its final place where the view does not change it, replicated where it
        does: the GDN ``[q | k | v]`` channels and repeated KV heads)."""
        if not self.heads_sharded or path.endswith(
            ("in_proj_qkv.weight", "conv_weight", "k_proj.weight", "v_proj.weight")
        ):
            return self.replicated
        spec = param_spec(path, shape, self.tp, expert_parallel=self.expert_parallel)
        return NamedSharding(self.mesh, spec)

    def memory_manager(
        self,
        layout: HybridLayout,
        budget_bytes: int | float,
        policy: str = "avmp",
        *,
        segment_bytes: int | None = None,
    ) -> MemoryManager:
        """The memory manager of this replica: one arena per device (``budget_bytes`` each)."""
        if self.tp == 1:
            return MemoryManager(
                layout, budget_bytes, policy, segment_bytes=segment_bytes, device=self.devices[0]
            )
        return ShardedMemoryManager(
            layout, budget_bytes, policy, placement=self, segment_bytes=segment_bytes
        )

    def __call__(self, buffer, table, handles, pages, lengths, spec, kernels, **kw):
        """The step programs' cache over this placement's arena (``kw``: ``defer``)."""
        if self.tp == 1:
            return ArenaCache(buffer, table, handles, pages, lengths, spec, kernels, **kw)
        return ShardedArenaCache(buffer, table, handles, pages, lengths, spec, kernels, self, **kw)


# ------------------------------------------------------------------------------ the arena


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "words"))
def _read_all(buf, seg, word, *, shape, dtype, words):
    def one(b):
        return words_to_field(lax.dynamic_slice(b, (seg, word), (1, words))[0], shape, dtype)

    return jax.vmap(one)(buf)


@functools.partial(jax.jit, donate_argnums=0)
def _write_all(buf, seg, word, value):
    words = field_to_words(value)[None]
    return jax.vmap(lambda b: lax.dynamic_update_slice(b, words, (seg, word)))(buf)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("words", "mesh"))
def _move_all(buf, moves, count, *, words, mesh):
    def local(b, m, c):
        return move_units(b[0], m, c, words=words)[None]

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(TENSOR), _R, _R), out_specs=P(TENSOR), check_vma=False
    )(buf, moves, count)


class ShardedArena(Arena):
    """One ``[num_segments, segment_words]`` arena per device of ``placement``'s ``tensor``
    axis, as one ``uint32 [T, num_segments, segment_words]`` buffer sharded on its leading
    axis. Unit moves run on every device at once (the same ``(segment, word)`` moves: one
    handle space); :meth:`read` returns every device's copy of a field, ``[T, *shape]``;
    :meth:`write` writes the same value on every device. ``nbytes`` is one device's."""

    def __init__(self, num_segments: int, segment_words: int, placement: Placement):
        check_arena_size(num_segments, segment_words)
        self.num_segments = num_segments
        self.segment_words = segment_words
        self.placement = placement
        shape = (placement.tp, num_segments, segment_words)
        self.buffer = allocate(
            jax.jit(lambda: jnp.zeros(shape, jnp.uint32), out_shardings=placement.arena_sharding),
            num_segments * segment_words * WORD_BYTES,
            placement.arena_sharding.device_set,
        )

    def _read_at(self, seg, word, *, shape, dtype, words):
        return _read_all(self.buffer, seg, word, shape=shape, dtype=dtype, words=words)

    def _write_at(self, seg, word, value) -> None:
        self.buffer = _write_all(self.buffer, seg, word, value)

    def _move_batch(self, table, count, words: int) -> None:
        self.buffer = _move_all(self.buffer, table, count, words=words, mesh=self.placement.mesh)


class ShardedMemoryManager(MemoryManager):
    """A :class:`MemoryManager` whose arena is a :class:`ShardedArena`: ``budget_bytes`` (and
    the layout) per device, one handle space for all devices, the device handle table
    replicated on the mesh."""

    def __init__(
        self,
        layout: HybridLayout,
        budget_bytes: int | float,
        policy: str = "avmp",
        *,
        placement: Placement,
        segment_bytes: int | None = None,
        **policy_args: Any,
    ):
        super().__init__(
            layout,
            budget_bytes,
            policy,
            segment_bytes=segment_bytes,
            device=placement.devices[0],
            **policy_args,
        )
        single = self.arena
        single.buffer.delete()  # freed before the per-device arenas are allocated
        self.arena = ShardedArena(single.num_segments, single.segment_words, placement)
        self._migrator.arena = self.arena
        self.placement = placement

    def _table_placement(self):
        """The ``[H, 2]`` translation table is replicated on every device of the mesh."""
        return self.placement.replicated


# ----------------------------------------------------------------------------- the cache


def _write_ssm(c: ArenaCache, gi: int, ssm: jax.Array) -> ArenaCache:
    """``c`` with GDN layer ``gi``'s recurrent state written (not its conv state; queued
    when ``c`` defers its writes)."""
    sp = c.spec
    seg, word = c._state_lookup(fresh=False)
    word = word + sp.state_offset + gi * sp.state_words
    rows = field_to_words(ssm.astype(sp.state_dtype), seg.shape[0])
    if getattr(c, "defer", False):
        return c._write(seg, word, rows)
    return dataclasses.replace(c, buffer=scatter_windows(c.buffer, seg, word, rows))


def _local_out(c: ArenaCache):
    """A local cache's buffer and queued writes, each with a leading device axis of 1."""
    pending = tuple((s[None], w[None], r[None]) for s, w, r in getattr(c, "pending", ()))
    return c.buffer[None], pending


@dataclasses.dataclass(frozen=True)
class ShardedArenaCache:
    """The batch's cache in a :class:`ShardedArena` (module docstring): the
    :class:`gdn_jax.models.StepCache` contract of :class:`ArenaCache`, each method run per
    device under ``shard_map`` on that device's arena ``buffer[d]`` and heads. Global arrays
    are split on their head axis (``[B, T, H, D]`` q/k/v on ``H``, ``[B, Hv, K, V]`` states on
    ``Hv``, ``[B, W-1, C]`` conv states on ``C``) when ``placement.heads_sharded``, replicated
    otherwise; handles, tables and lengths are replicated. A pytree (``spec``, ``kernels``,
    ``placement`` and ``defer`` static). With ``defer`` the windowed writes wait in ``pending``
    (each ``(segment, word, rows)`` with a leading device axis) until :meth:`flush`, as
    :class:`ArenaCache`'s do."""

    buffer: jax.Array
    table: jax.Array
    state_handles: jax.Array
    page_handles: jax.Array
    lengths: jax.Array
    spec: ArenaSpec
    kernels: ArenaKernels
    placement: Placement
    pending: tuple = ()
    defer: bool = False

    # ---------------------------------------------------------------------------- helpers

    def _h(self, axis: int) -> P:
        """The spec of a global array split over ``tensor`` on ``axis`` (replicated when the
        model is)."""
        if not self.placement.heads_sharded:
            return _R
        return P(*([None] * axis), TENSOR)

    def _run(self, fn, in_specs, out_specs, *args):
        """``fn(local ArenaCache, *local args)`` on every device."""
        spec, kernels = self.spec, self.kernels
        kw = {"defer": True} if self.defer else {}

        def body(buf, table, handles, pages, lengths, *a):
            return fn(ArenaCache(buf[0], table, handles, pages, lengths, spec, kernels, **kw), *a)

        return jax.shard_map(
            body,
            mesh=self.placement.mesh,
            in_specs=(P(TENSOR), _R, _R, _R, _R, *in_specs),
            out_specs=out_specs,
            check_vma=False,
        )(self.buffer, self.table, self.state_handles, self.page_handles, self.lengths, *args)

    def _update(self, fn, in_specs, *args) -> ShardedArenaCache:
        """The cache after ``fn(local cache, *args) -> local cache`` on every device."""
        buf, new = self._run(lambda c, *a: _local_out(fn(c, *a)), in_specs, P(TENSOR), *args)
        return dataclasses.replace(self, buffer=buf, pending=self.pending + new)

    def flush(self, *after):
        """The queued writes applied on every device behind one ``optimization_barrier``
        (:meth:`ArenaCache.flush`): the cache, or ``(cache, after)``."""
        if not self.pending:
            return (self, after) if after else self
        buf, pending, after_ = lax.optimization_barrier((self.buffer, self.pending, after))

        def apply(b, pend):
            b = b[0]
            for seg, word, rows in pend:
                b = scatter_windows(b, seg[0], word[0], rows[0])
            return b[None]

        buf = jax.shard_map(
            apply,
            mesh=self.placement.mesh,
            in_specs=(P(TENSOR), P(TENSOR)),
            out_specs=P(TENSOR),
            check_vma=False,
        )(buf, pending)
        cache = dataclasses.replace(self, buffer=buf, pending=())
        return (cache, after_) if after else cache

    def _tree_cache_spec(self, qk_l2norm: bool) -> TreeCache:
        h = self._h(2)
        return TreeCache(h, h, h, _R, qk_l2norm)

    def _tree_spec(self, gdn, conv_in: bool, draft_kv: bool) -> TreeState:
        return TreeState(
            tuple(gdn),
            self._h(3) if conv_in else _R,
            self._h(3) if draft_kv else _R,
            self._h(3) if draft_kv else _R,
        )

    # ----------------------------------------------------------------------------- GDN

    def gdn_conv_state(self, gi: int) -> jax.Array:
        return self._run(lambda c: c.gdn_conv_state(gi), (), self._h(2))

    def gdn_state(self, gi: int) -> tuple[jax.Array, jax.Array]:
        return self._run(lambda c: c.gdn_state(gi), (), (self._h(2), self._h(1)))

    def with_gdn_conv_state(self, gi: int, conv: jax.Array) -> ShardedArenaCache:
        return self._update(lambda c, x: c.with_gdn_conv_state(gi, x), (self._h(2),), conv)

    def with_gdn_state(self, gi: int, conv: jax.Array, ssm: jax.Array) -> ShardedArenaCache:
        return self._update(
            lambda c, x, s: c.with_gdn_state(gi, x, s), (self._h(2), self._h(1)), conv, ssm
        )

    def gdn_tree_rule(self, gi: int, n: int):
        """Always a rule: tree WY verify of each device's heads on its own states (the arena
        kernel where selected, else :func:`gdn_jax.tree_verify` on the read state)."""
        impl = self.placement.impl

        def rule(q, k, v, g, beta, parents, *, use_qk_l2norm: bool):
            def local(c, q, k, v, g, beta, parents):
                kernel = c.gdn_tree_rule(gi, n)
                if kernel is not None:
                    return kernel(q, k, v, g, beta, parents, use_qk_l2norm=use_qk_l2norm)
                _, ssm = c.gdn_state(gi)
                return tree_verify(
                    q, k, v, g, beta, parents, ssm, use_qk_l2norm=use_qk_l2norm, impl=impl
                )

            h = self._h(2)
            return self._run(
                local,
                (h, h, h, h, h, _R),
                (h, self._tree_cache_spec(use_qk_l2norm)),
                q,
                k,
                v,
                g,
                beta,
                parents,
            )

        return rule

    def _sequence_rule(self, gi: int, num_tokens: jax.Array | None):
        """A one-token (``num_tokens is None``) or prefill rule: each device's heads from its
        own states, the new states written in place (kernel where selected, else the chunked
        rule on the read state, as the default path runs it)."""
        impl = self.placement.impl

        def rule(q, k, v, g, beta, *, use_qk_l2norm: bool):
            def local(c, q, k, v, g, beta, nt):
                kernel = c.gdn_step_rule(gi) if nt is None else c.gdn_prefill_rule(gi, nt)
                if kernel is not None:
                    o, c2 = kernel(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm)
                    return o, _local_out(c2)
                _, ssm = c.gdn_state(gi)
                o, new = chunk_gated_delta_rule(
                    q, k, v, g, beta, ssm, use_qk_l2norm=use_qk_l2norm, impl=impl
                )
                return o, _local_out(_write_ssm(c, gi, new))

            h = self._h(2)
            o, (buf, new) = self._run(
                local, (h, h, h, h, h, _R), (h, P(TENSOR)), q, k, v, g, beta, num_tokens
            )
            return o, dataclasses.replace(self, buffer=buf, pending=self.pending + new)

        return rule

    def gdn_step_rule(self, gi: int):
        return self._sequence_rule(gi, None)

    def attention_decode_rule(self, ai: int):
        return None  # the per-device K/V writes of write_kv

    def gdn_prefill_rule(self, gi: int, num_tokens: jax.Array):
        return self._sequence_rule(gi, num_tokens)

    def commit_gdn_state(
        self, gi: int, tc: TreeCache, path: jax.Array, path_len: jax.Array
    ) -> ShardedArenaCache:
        """Always commits in place: each device's heads (the commit kernel where selected,
        else :func:`gdn_jax.tree_commit` on the read state)."""
        impl = self.placement.impl

        def local(c, tc, path, path_len):
            done = c.commit_gdn_state(gi, tc, path, path_len)
            if done is None:
                _, ssm = c.gdn_state(gi)
                done = _write_ssm(c, gi, tree_commit(ssm, tc, path, path_len, impl=impl))
            return done

        return self._update(
            local, (self._tree_cache_spec(tc.qk_l2norm), _R, _R), tc, path, path_len
        )

    # ----------------------------------------------------------------------- attention

    def write_kv(self, ai, positions, k, v, valid) -> ShardedArenaCache:
        h = self._h(2)
        return self._update(
            lambda c, p, k, v, ok: c.write_kv(ai, p, k, v, ok),
            (_R, h, h, _R),
            positions,
            k,
            v,
            valid,
        )

    def attention(
        self, ai, q, kv_len, q_pos, *, scale, draft_k=None, draft_v=None, draft_mask=None
    ) -> jax.Array:
        h = self._h(2)
        if draft_k is None:
            return self._run(
                lambda c, q, kl, qp: c.attention(ai, q, kl, qp, scale=scale),
                (h, _R, _R),
                h,
                q,
                kv_len,
                q_pos,
            )
        return self._run(
            lambda c, q, kl, qp, dk, dv, dm: c.attention(
                ai, q, kl, qp, scale=scale, draft_k=dk, draft_v=dv, draft_mask=dm
            ),
            (h, _R, _R, h, h, _R),
            h,
            q,
            kv_len,
            q_pos,
            draft_k,
            draft_v,
            draft_mask,
        )

    def with_lengths(self, lengths: jax.Array) -> ShardedArenaCache:
        return dataclasses.replace(self, lengths=lengths)

    # -------------------------------------------------------------- speculative scratch

    def write_tree_state(self, tree: TreeState, scratch: jax.Array) -> ShardedArenaCache:
        gdn = [
            self._tree_cache_spec(t.qk_l2norm) if isinstance(t, TreeCache) else self._h(2)
            for t in tree.gdn
        ]
        spec = self._tree_spec(gdn, tree.conv_in.ndim > 1, tree.draft_k.ndim > 1)
        return self._update(lambda c, t, s: c.write_tree_state(t, s), (spec, _R), tree, scratch)

    def read_tree_state(self, scratch, path, path_len, *, qk_l2norm: bool) -> TreeState:
        sp = self.spec
        if scratch.ndim == 1:
            gdn = [self._tree_cache_spec(qk_l2norm)] * sp.gdn_layers
        else:
            gdn = [self._h(2)] * sp.gdn_layers
        out = self._tree_spec(gdn, sp.gdn_layers > 0, sp.attn_layers > 0)
        return self._run(
            lambda c, s, p, n: c.read_tree_state(s, p, n, qk_l2norm=qk_l2norm),
            (_R, _R, _R),
            out,
            scratch,
            path,
            path_len,
        )


jax.tree_util.register_dataclass(
    ShardedArenaCache,
    data_fields=["buffer", "table", "state_handles", "page_handles", "lengths", "pending"],
    meta_fields=["spec", "kernels", "placement", "defer"],
)


# ---------------------------------------------------------------------- data parallelism


class ReplicaScheduler:
    """The schedulers of data-parallel engine replicas behind the one-scheduler interface the
    ``LLM`` uses (``add``, ``abort``, ``waiting``, ``running``): a new request goes to the
    replica with the fewest requests (ties: the first), and stays there."""

    def __init__(self, schedulers: Sequence):
        self.schedulers = list(schedulers)
        self._home: dict = {}
        self._prune_at = 64

    def add(self, req) -> None:
        if len(self._home) >= self._prune_at:  # forget finished requests now and then
            self._home = {k: v for k, v in self._home.items() if not v[1].finished}
            self._prune_at = 2 * len(self._home) + 64
        s = min(self.schedulers, key=lambda x: len(x.waiting) + len(x.running))
        self._home[req.rid] = (s, req)
        s.add(req)

    def abort(self, req) -> None:
        home = self._home.pop(req.rid, None)
        if home is not None:
            home[0].abort(req)

    @property
    def waiting(self) -> list:
        return [r for s in self.schedulers for r in s.waiting]

    @property
    def running(self) -> list:
        return [r for s in self.schedulers for r in s.running]


class ReplicaEngine:
    """The engines of data-parallel replicas behind the one-engine interface the ``LLM``
    uses: :meth:`step` runs one iteration of every replica that has work, each in its own
    thread (a replica's programs run on its own devices, so they overlap)."""

    def __init__(self, engines: Sequence):
        self.engines = list(engines)
        self._pool: ThreadPoolExecutor | None = None

    def step(self) -> None:
        busy = [e for e in self.engines if e.sched.waiting or e.sched.running]
        if len(busy) <= 1:
            for e in busy:
                e.step()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="dp-replica")
        for f in [self._pool.submit(e.step) for e in busy]:
            f.result()

    def compiled(self) -> int:
        return sum(e.compiled() for e in self.engines)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.engines[0].buckets

    @property
    def progress(self):
        return self.engines[0].progress

    @progress.setter
    def progress(self, fn) -> None:
        for e in self.engines:
            e.progress = fn
