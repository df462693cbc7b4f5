"""The model's cache stored in the memory manager's arena, read and written through its handles.

:class:`ArenaCache` has the methods :mod:`gdn_jax.models.steps` calls on a cache
(``lengths``, ``gdn_state``, ``with_gdn_state``, ``write_kv``, ``attention``, ``with_lengths``;
see :class:`gdn_jax.models.cache.ModelCache`), but holds no cache array of its own: only the
arena buffer (``uint32 [segments, segment_words]``, donated by the jitted steps so every write
is in place), the device handle table (``int32 [H, 2]``: handle -> ``(segment, word)``,
:meth:`MemoryManager.device_table`), each row's ``state`` handle and its page table of ``kv``
handles. Inside the jitted step every access goes handle -> table -> ``(segment, word)`` ->
the field's word offset (static, from the manager's layout):

- GDN layer ``gi`` of a row: one window of the row's state unit, ``recurrent[gi]`` (f32,
  ``Hv*K*V`` words) and ``conv[gi]`` (``(W-1)*C`` elements bitcast from words), read with a
  windowed gather over the batch rows (what ``vmap`` of :func:`serving.memory.view`'s
  ``dynamic_slice`` + bitcast lowers to) and written back with a windowed scatter (a
  ``dynamic_update_slice`` per row) into the arena;
- attention layer ``ai``: K and V of ``page_size`` tokens are one contiguous window of a
  ``kv`` unit (the unit is ``[La, 2, S, Hkv, D]``); a new token's K/V is a window of
  ``Hkv*D`` elements written by scatter; attention reads the row's pages by a windowed gather.

- speculative scratch (:meth:`ArenaCache.write_tree_state`, :meth:`ArenaCache.read_tree_state`):
  the ``TreeState`` of a tree verify, written into each row's scratch units (its ``stash``
  unit: fields ``u, k, g, x, dk, dv``, one windowed scatter per field; or its ``N``
  ``snapshot`` units: per node its states in ``recurrent`` and its pre-conv inputs and draft
  K/V packed at the start of ``conv``) and read back by the commit (one windowed gather per
  field; of the snapshot units only the accepted leaf's states). A scratch handle of ``-1``
  (padding row) writes nothing.

Rows whose state handle is ``-1`` (padding) or whose length is 0 (a fresh request: its unit
holds whatever was there before) read zero states; writes of padding rows and unmapped pages
go to segment ``num_segments``, which the scatter drops. KV positions at or past the row's
length are zeroed before attention (a recycled page can hold any bits, NaN patterns included).

What the XLA path does not do: its attention read is a gather of the row's pages into a
``[B, pages * S, Hkv, D]`` temporary per layer (as ``gather_pages`` was on the pooled path),
and its GDN verify / commit gather each layer's state window (no copy of the whole state).

Kernels (:class:`ArenaKernels`, chosen by :func:`select_kernels`; ``ArenaRunner(kernels=)``):
with the Pallas kernels the tree verify reads the GDN recurrent states in place through the
table (:func:`pallas_kernels.arena.tree_verify`), every attention layer reads the KV pages in
place (the tree verify's by :func:`pallas_kernels.arena_attention.tree_attention`, decode's
and prefill's, causal, by :func:`pallas_kernels.arena_attention.paged_attention`), and the
commit updates the recurrent states in place (:func:`pallas_kernels.arena.tree_commit`, the
arena aliased); with ``kernels="pallas"`` the decode step's GDN layers also read and write
their recurrent states in place (:func:`pallas_kernels.arena_decode.recurrent_step`, the arena
aliased), and prefill's GDN layers (``T > 1`` tokens per row) read their initial recurrent
states and write the final ones in place (:func:`pallas_kernels.arena_prefill.
recurrent_prefill`, the arena aliased; ``kernels="auto"`` keeps XLA's chunked prefill). Still
XLA windows on that path: the conv state (``(W-1)*C`` elements per layer), the K/V writes
(decode's and prefill's new tokens, the accepted nodes'), the snapshot verify method and the
speculative scratch's writes and reads (the commit kernel gets the stash's ``k, u, g`` read
out by XLA windows). Rows at length 0 read zero states on both
paths; a commit of a length-0 row (which the engine never issues: it verifies only prefilled
requests) leaves that row's recurrent state unwritten on the kernel path.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from gdn_jax import TreeCache
from gdn_jax.models.cache import TreeState
from gdn_jax.models.tree_attention import attend
from serving.memory.layout import WORD_BYTES, Field

_MODE = lax.GatherScatterMode.FILL_OR_DROP
KERNEL_CHOICES = ("xla", "pallas", "auto")
# "auto" takes the tree kernels up to gdn_jax.pallas_routes.AUTO_MAX_NODES nodes (where the dense
# kernels were measured faster than XLA on the H200); an explicit "pallas" up to
# pallas_kernels.MAX_NODES.


@dataclasses.dataclass(frozen=True)
class ArenaSpec:
    """Static geometry of the arena's units as the model's step functions see them (word
    offsets inside a unit; every block used below starts and ends on a word boundary)."""

    gdn_layers: int
    state_shape: tuple[int, ...]  # [Hv, K, V] per layer, f32
    state_dtype: str
    state_offset: int  # words of recurrent[0] from the unit start
    conv_shape: tuple[int, ...]  # [W-1, C] per layer
    conv_dtype: str
    conv_offset: int
    attn_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_offset: int
    model_dtype: str
    # the stash unit's fields (u, k, g, x, dk, dv; serving.memory.layout), for the speculative
    # scratch (ArenaCache.write_tree_state / read_tree_state); empty: no scratch in the arena
    stash: tuple[Field, ...] = ()

    @staticmethod
    def from_layout(layout, model_dtype, config=None, *, draft: bool = False) -> ArenaSpec:
        """From the manager's (effective) layout; checks it matches the model ``config``
        (a :class:`gdn_jax.models.ModelConfig`) when given. ``draft=True``: the draft
        model's ``draft_*`` fields of the same units (no speculative scratch)."""
        prefix = "draft_" if draft else ""
        if draft and layout.draft is None:
            raise ValueError("draft=True: the memory layout has no draft model (layout.draft)")

        def named(kind):
            return {
                f.name.removeprefix(prefix): f
                for f in layout.fields(kind)
                if f.name.startswith(prefix) and (draft or not f.name.startswith("draft_"))
            }

        state, kv = named("state"), named("kv")["kv"]
        rec, conv = state["recurrent"], state["conv"]
        lg, la = rec.shape[0], kv.shape[0]
        if config is not None:
            want = {
                "recurrent": (
                    len(config.gdn_layers),
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                ),
                "conv": (
                    len(config.gdn_layers),
                    config.linear_conv_kernel_dim - 1,
                    config.conv_dim,
                ),
                "kv": (
                    len(config.attn_layers),
                    2,
                    layout.page_size,
                    config.num_key_value_heads,
                    config.head_dim,
                ),
            }
            for f in (rec, conv, kv):
                if f.shape != want[f.name.removeprefix(prefix)]:
                    raise ValueError(
                        f"memory layout field {f.name!r} has shape {f.shape}, the model needs "
                        f"{want[f.name.removeprefix(prefix)]}: build the manager with "
                        "layout_for(config, page_size)"
                    )
        spec = ArenaSpec(
            gdn_layers=lg,
            state_shape=rec.shape[1:],
            state_dtype=str(rec.dtype),
            state_offset=rec.word_offset,
            conv_shape=conv.shape[1:],
            conv_dtype=str(conv.dtype),
            conv_offset=conv.word_offset,
            attn_layers=la,
            page_size=layout.page_size,
            kv_heads=kv.shape[3],
            head_dim=kv.shape[4],
            kv_dtype=str(kv.dtype),
            kv_offset=kv.word_offset,
            model_dtype=str(jnp.dtype(model_dtype)),
            stash=() if draft else layout.fields("stash"),
        )
        for name, shape, dtype in (
            ("recurrent", spec.state_shape, spec.state_dtype),
            ("conv", spec.conv_shape, spec.conv_dtype),
            ("kv (one token)", (spec.kv_heads, spec.head_dim), spec.kv_dtype),
        ):
            if math.prod(shape) * jnp.dtype(dtype).itemsize % WORD_BYTES:
                raise ValueError(
                    f"arena cache: one layer's {name} block {shape} {dtype} is not a whole "
                    f"number of {WORD_BYTES}-byte words"
                )
        return spec

    @property
    def state_words(self) -> int:
        return _words(self.state_shape, self.state_dtype)

    @property
    def conv_words(self) -> int:
        return _words(self.conv_shape, self.conv_dtype)

    @property
    def token_words(self) -> int:
        """Words of one token's K (or V) of one attention layer."""
        return _words((self.kv_heads, self.head_dim), self.kv_dtype)

    @property
    def spec_nodes(self) -> int:
        """Draft-tree nodes one ``stash`` unit holds (0: no stash fields)."""
        return self.stash[0].shape[1] if self.stash else 0

    def snapshot_packing(self) -> tuple[int, int, int]:
        """Words of one node's ``(pre-conv inputs [Lg, C], draft K [La, Hkv, D], draft V)``
        as packed at the start of a ``snapshot`` unit's ``conv`` field (whole words each);
        ``ValueError`` when they do not fit in it."""
        c = self.conv_shape[1]
        x = _ceil_words(self.gdn_layers * c, self.conv_dtype)
        kv = _ceil_words(self.attn_layers * self.kv_heads * self.head_dim, self.kv_dtype)
        room = self.gdn_layers * self.conv_words
        if x + 2 * kv > room:
            raise ValueError(
                f"snapshot verify: one node's pre-conv inputs ({x} words) and draft K/V "
                f"({2 * kv} words) do not fit in a snapshot unit's conv field ({room} words); "
                "use the tree-WY verify (stash units)"
            )
        return x, kv, kv


@dataclasses.dataclass(frozen=True)
class ArenaKernels:
    """Static choice of how the arena path's tree verify and commit run (:func:`select_kernels`).

    - ``gdn``: GDN tree verify and commit by :mod:`pallas_kernels.arena` (the recurrent states
      read, and committed, in place through the table) instead of XLA state windows;
    - ``attention``: every attention layer by :mod:`pallas_kernels.arena_attention` (the KV
      pages read in place) instead of XLA's page gather: the tree verify's
      (``tree_attention``), decode's and prefill's (``paged_attention``, causal);
    - ``decode``: the decode step's GDN layers by :mod:`pallas_kernels.arena_decode` (the
      recurrent states read and written in place) instead of XLA state windows;
    - ``prefill``: prefill's GDN layers (``T > 1`` tokens per row) by
      :mod:`pallas_kernels.arena_prefill` (the initial states read, the final ones written, in
      place) instead of XLA state windows and the chunked rule;
    - ``interpret``: run them in Pallas interpret mode (any non-GPU backend);
    - ``max_nodes``: the largest draft tree they take; a larger one runs on XLA, or raises a
      ``ValueError`` when ``strict`` (``kernels="pallas"`` asked for explicitly).
    """

    gdn: bool = False
    attention: bool = False
    decode: bool = False
    prefill: bool = False
    interpret: bool = False
    max_nodes: int = 0
    strict: bool = False

    @property
    def name(self) -> str:
        """``"pallas"`` when any step uses a kernel, else ``"xla"``."""
        return "pallas" if self.gdn or self.attention or self.decode or self.prefill else "xla"

    def takes(self, n: int, what: str) -> bool:
        """Whether a tree of ``n`` nodes goes to the kernels (static, at trace time)."""
        if n <= self.max_nodes:
            return True
        if self.strict:
            raise ValueError(
                f"kernels='pallas': the arena {what} kernel takes trees of at most "
                f"{self.max_nodes} nodes, got N={n}; use kernels='auto' or 'xla'"
            )
        return False


XLA_KERNELS = ArenaKernels()


def _pow2(x: int, lo: int = 16, hi: int | None = None) -> bool:
    return x >= lo and x & (x - 1) == 0 and (hi is None or x <= hi)


def _gdn_misfits(spec: ArenaSpec, config) -> list[str]:
    """Why the arena GDN kernels cannot take this geometry (empty: they can)."""
    out = []
    hv, dk, dv = spec.state_shape
    if jnp.dtype(spec.state_dtype) != jnp.float32:
        out.append(f"the recurrent state is {spec.state_dtype}; the GDN kernels read float32")
    for name, x in (("linear_key_head_dim", dk), ("linear_value_head_dim", dv)):
        if not _pow2(x, 16, 256):
            out.append(f"{name} {x} is not a power of two in [16, 256]")
    if jnp.dtype(spec.model_dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        out.append(f"model dtype {spec.model_dtype} is not float32, bfloat16 or float16")
    if config is not None and hv % config.linear_num_key_heads:
        out.append(f"linear_num_value_heads {hv} is not a multiple of the key heads")
    return out


def _attention_misfits(spec: ArenaSpec, config) -> list[str]:
    """Why the arena paged tree-attention kernel cannot take this geometry."""
    out = []
    if jnp.dtype(spec.kv_dtype) not in (jnp.float32, jnp.bfloat16):
        out.append(f"the KV cache is {spec.kv_dtype}; the attention kernel reads f32 or bf16")
    for name, x in (("page_size", spec.page_size), ("head_dim", spec.head_dim)):
        if not _pow2(x):
            out.append(f"{name} {x} is not a power of two >= 16")
    if config is not None and config.num_attention_heads % spec.kv_heads:
        out.append("num_attention_heads is not a multiple of num_key_value_heads")
    return out


def select_kernels(
    kernels: str, spec: ArenaSpec, config=None, backend: str | None = None
) -> tuple[ArenaKernels, tuple[str, ...]]:
    """Resolves ``kernels`` (``"xla"`` | ``"pallas"`` | ``"auto"``) for the arena geometry
    ``spec`` (and the model ``config``, when given) on ``backend`` (default: JAX's).

    ``"auto"``: the kernels on a GPU backend where the geometry fits them (per part: GDN,
    attention), XLA elsewhere; ``"pallas"``: the kernels everywhere (interpret mode off GPU),
    a ``ValueError`` naming ``kernels`` when the geometry does not fit. Returns the choice and
    the reasons for every part left on XLA."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "xla":
        return XLA_KERNELS, ()
    backend = backend or jax.default_backend()
    if kernels == "auto" and backend != "gpu":
        return XLA_KERNELS, (f"kernels='auto' on the {backend} backend: the arena Pallas "
                             "kernels (Triton) are taken on GPU only",)  # fmt: skip
    from gdn_jax.pallas_routes import AUTO_MAX_NODES
    from pallas_kernels import MAX_NODES

    interpret = backend != "gpu"
    if interpret:
        # The first interpret-mode call imports the Pallas fuser, which registers a jax config
        # option that is part of every jit cache key: import it now, before the engine
        # compiles anything, or each program compiled earlier would compile again after it.
        from jax.experimental.pallas import fuser  # noqa: F401

    gdn_bad = _gdn_misfits(spec, config) if spec.gdn_layers else []
    attn_bad = _attention_misfits(spec, config) if spec.attn_layers else []
    if kernels == "pallas" and (gdn_bad or attn_bad):
        raise ValueError(f"kernels='pallas': {'; '.join(gdn_bad + attn_bad)}")
    notes = tuple(f"GDN verify/commit on XLA: {r}" for r in gdn_bad) + tuple(
        f"tree attention on XLA: {r}" for r in attn_bad
    )
    choice = ArenaKernels(
        gdn=spec.gdn_layers > 0 and not gdn_bad,
        attention=spec.attn_layers > 0 and not attn_bad,
        # The decode kernel under "auto" too: on the H200 a 30-layer Qwen3.5-35B decode step
        # takes 0.35-0.62x the time of XLA's state windows (benchmarks/arena_read.py, B 1-64).
        decode=spec.gdn_layers > 0 and not gdn_bad,
        # The prefill kernel (a sequential scan over each chunk's tokens) only when asked for:
        # on the H200 it takes 1.38-1.97x the time of the state windows + the chunked Pallas
        # prefill at the default 64-token chunk, 0.82-0.87x at 16 (benchmarks/arena_read.py
        # --step prefill, B 1-64, session 7), so "auto" keeps the chunked rule.
        prefill=kernels == "pallas" and spec.gdn_layers > 0 and not gdn_bad,
        interpret=interpret,
        max_nodes=MAX_NODES if kernels == "pallas" else AUTO_MAX_NODES,
        strict=kernels == "pallas",
    )
    return choice, notes


def _words(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize // WORD_BYTES


def _ceil_words(count: int, dtype) -> int:
    """Words ``count`` elements of ``dtype`` take, the last one zero-padded."""
    return -(-count * jnp.dtype(dtype).itemsize // WORD_BYTES)


def _pack(x: jax.Array, rows: int, dtype) -> jax.Array:
    """``x`` (leading axis ``rows``) cast to ``dtype`` as ``uint32 [rows, words]``, bit for bit,
    zero-padded to whole words."""
    flat = x.astype(dtype).reshape(rows, -1)
    ratio = WORD_BYTES // flat.dtype.itemsize
    pad = -flat.shape[1] % ratio
    if pad:
        flat = jnp.pad(flat, ((0, 0), (0, pad)))
    return _to_words(flat, rows)


def _unpack(raw: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """``uint32 [..., words]`` (:func:`_pack`'s output) as ``[..., *shape]`` of ``dtype``."""
    out = lax.bitcast_convert_type(raw, jnp.dtype(dtype))
    out = out.reshape(*raw.shape[:-1], -1)[..., : math.prod(shape)]
    return out.reshape(*raw.shape[:-1], *shape)


def _to_words(x: jax.Array, rows: int) -> jax.Array:
    """``x`` (leading axis ``rows``) as ``uint32 [rows, words]``, bit for bit."""
    ratio = WORD_BYTES // x.dtype.itemsize
    flat = x.reshape(rows, -1)
    if ratio > 1:
        flat = flat.reshape(rows, -1, ratio)
    return lax.bitcast_convert_type(flat, jnp.uint32)


def _from_words(raw: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """``uint32 [..., words]`` reinterpreted as ``[..., *shape]`` of ``dtype``."""
    out = lax.bitcast_convert_type(raw, jnp.dtype(dtype))  # [..., w] or [..., w, ratio]
    return out.reshape(*raw.shape[:-1], *shape)


def gather_windows(buffer: jax.Array, seg: jax.Array, word: jax.Array, words: int) -> jax.Array:
    """``buffer[seg[i], word[i] : word[i] + words]`` for every index ``i`` (any batch shape):
    ``uint32 [..., words]``. An out-of-range ``seg`` (e.g. ``num_segments``) reads zeros."""
    idx = jnp.stack([seg, word], axis=-1).astype(jnp.int32)
    dnums = lax.GatherDimensionNumbers(
        offset_dims=(idx.ndim - 1,), collapsed_slice_dims=(0,), start_index_map=(0, 1)
    )
    return lax.gather(buffer, idx, dnums, slice_sizes=(1, words), mode=_MODE, fill_value=0)


def scatter_windows(
    buffer: jax.Array, seg: jax.Array, word: jax.Array, rows: jax.Array
) -> jax.Array:
    """``buffer[seg[i], word[i] : word[i] + w] = rows[i]`` (``rows uint32 [n, w]``, ``seg,
    word [n]``); out-of-range windows are dropped. In place when ``buffer`` is donated."""
    idx = jnp.stack([seg, word], axis=-1).astype(jnp.int32)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(buffer, idx, rows, dnums, mode=_MODE)


@dataclasses.dataclass(frozen=True)
class ArenaCache:
    """A batch's cache inside the arena (module docstring). ``state_handles int32 [B]``
    (``-1``: padding row), ``page_handles int32 [B, MP]`` (``-1``: unmapped), ``lengths
    int32 [B]`` committed tokens. A pytree; ``spec`` is static."""

    buffer: jax.Array
    table: jax.Array
    state_handles: jax.Array
    page_handles: jax.Array
    lengths: jax.Array
    spec: ArenaSpec
    kernels: ArenaKernels = XLA_KERNELS

    @property
    def _oob(self) -> int:
        return self.buffer.shape[0]

    def _lookup(self, handles: jax.Array, ok: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(segment, word)`` of ``handles`` through the table; ``segment = num_segments``
        (out of range: reads zeros, writes dropped) where not ``ok``."""
        entry = self.table[jnp.maximum(handles, 0)]
        return jnp.where(ok, entry[..., 0], self._oob), entry[..., 1]

    # --------------------------------------------------------------------------------- GDN

    def _state_lookup(self, fresh: bool) -> tuple[jax.Array, jax.Array]:
        """``(segment, word)`` of each row's state unit; with ``fresh``, rows at length 0
        (and padding) read out of range, i.e. zeros."""
        h = self.state_handles
        ok = (h >= 0) & (self.lengths > 0) if fresh else h >= 0
        return self._lookup(h, ok)

    def gdn_conv_state(self, gi: int) -> jax.Array:
        """``conv [B, W-1, C]`` (model dtype) of GDN layer ``gi``."""
        sp = self.spec
        seg, word = self._state_lookup(fresh=True)
        conv = gather_windows(
            self.buffer, seg, word + sp.conv_offset + gi * sp.conv_words, sp.conv_words
        )
        return _from_words(conv, sp.conv_shape, sp.conv_dtype).astype(sp.model_dtype)

    def gdn_state(self, gi: int) -> tuple[jax.Array, jax.Array]:
        """``(conv [B, W-1, C] model dtype, ssm [B, Hv, K, V] f32)`` of GDN layer ``gi``."""
        sp = self.spec
        seg, word = self._state_lookup(fresh=True)
        ssm = gather_windows(
            self.buffer, seg, word + sp.state_offset + gi * sp.state_words, sp.state_words
        )
        ssm = _from_words(ssm, sp.state_shape, sp.state_dtype).astype(jnp.float32)
        return self.gdn_conv_state(gi), ssm

    def with_gdn_conv_state(self, gi: int, conv: jax.Array) -> ArenaCache:
        sp = self.spec
        seg, word = self._state_lookup(fresh=False)
        buf = scatter_windows(
            self.buffer,
            seg,
            word + sp.conv_offset + gi * sp.conv_words,
            _to_words(conv.astype(sp.conv_dtype), seg.shape[0]),
        )
        return dataclasses.replace(self, buffer=buf)

    def with_gdn_state(self, gi: int, conv: jax.Array, ssm: jax.Array) -> ArenaCache:
        sp = self.spec
        seg, word = self._state_lookup(fresh=False)
        buf = scatter_windows(
            self.buffer,
            seg,
            word + sp.state_offset + gi * sp.state_words,
            _to_words(ssm.astype(sp.state_dtype), seg.shape[0]),
        )
        return dataclasses.replace(self, buffer=buf).with_gdn_conv_state(gi, conv)

    # ------------------------------------------------------------ in-place kernels (Pallas)

    def _kernel_table(self) -> jax.Array:
        """The table as the kernels get it: a padding row reads through ``table[0]``, which is
        ``(-1, -1)`` while handle 0 is free, so clamp to an in-bounds (ignored) address."""
        return jnp.maximum(self.table, 0)

    def _kernel_handles(self) -> jax.Array:
        """State handles for the GDN kernels: ``-1`` (a zero state, never written) for padding
        rows and rows at length 0, as the XLA path reads them."""
        h = self.state_handles
        return jnp.where((h >= 0) & (self.lengths > 0), h, -1)

    def gdn_tree_rule(self, gi: int, n: int):
        """The tree-verify rule of GDN layer ``gi`` for ``n`` nodes reading its recurrent state
        in place (:func:`pallas_kernels.arena.tree_verify`): ``rule(q, k, v, g, beta, parents,
        *, use_qk_l2norm) -> (o, TreeCache)``; ``None`` on the XLA path (then
        :meth:`gdn_state` gives the state)."""
        kn = self.kernels
        if not kn.gdn or not kn.takes(n, "GDN tree verify"):
            return None
        from gdn_jax.pallas_routes import verify_blocks_for
        from pallas_kernels import arena as pa

        sp = self.spec

        def rule(q, k, v, g, beta, parents, *, use_qk_l2norm: bool):
            blocks = verify_blocks_for(q, k, v, kn.interpret)
            o, u, g_path = pa.tree_verify(
                q, k, v, g, beta, parents, self.buffer, self._kernel_table(),
                self._kernel_handles(), state_offset=sp.state_offset + gi * sp.state_words,
                use_qk_l2norm=use_qk_l2norm, blocks=blocks, interpret=kn.interpret,
            )  # fmt: skip
            return o, TreeCache(u, k, g_path, parents.astype(jnp.int32), use_qk_l2norm)

        return rule

    def gdn_step_rule(self, gi: int):
        """The one-token (decode) rule of GDN layer ``gi`` reading and writing its recurrent
        state in place (:func:`pallas_kernels.arena_decode.recurrent_step`, the arena aliased):
        ``rule(q, k, v, g, beta, *, use_qk_l2norm) -> (o [B, 1, Hv, V], ArenaCache)`` on
        ``[B, 1, ...]`` inputs, the returned cache holding the updated arena; ``None`` unless
        the decode kernel is selected (then :meth:`gdn_state` / :meth:`with_gdn_state`).

        As the XLA path: rows at length 0 start from a zero state and are written; padding rows
        (handle ``-1``) run from a zero state and are not written."""
        kn = self.kernels
        if not kn.decode:
            return None
        from pallas_kernels.arena_decode import recurrent_step

        sp = self.spec
        h = self.state_handles

        def rule(q, k, v, g, beta, *, use_qk_l2norm: bool):
            o, buf = recurrent_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], self.buffer,
                self._kernel_table(), jnp.where(h >= 0, h, -1),
                state_offset=sp.state_offset + gi * sp.state_words,
                use_qk_l2norm=use_qk_l2norm, zero_state=self.lengths <= 0,
                interpret=kn.interpret,
            )  # fmt: skip
            return o[:, None], dataclasses.replace(self, buffer=buf)

        return rule

    def gdn_prefill_rule(self, gi: int, num_tokens: jax.Array):
        """The prefill rule of GDN layer ``gi`` (``T > 1`` tokens per row, the first
        ``num_tokens[b]`` of row ``b`` live) reading its initial recurrent state and writing the
        final one in place (:func:`pallas_kernels.arena_prefill.recurrent_prefill`, the arena
        aliased): ``rule(q, k, v, g, beta, *, use_qk_l2norm) -> (o [B, T, Hv, V], ArenaCache)``,
        the returned cache holding the updated arena; ``None`` unless the prefill kernel is
        selected (then :meth:`gdn_state` / :meth:`with_gdn_state`).

        As the XLA path: rows at length 0 start from a zero state and are written (also with
        no live token); padding rows (handle ``-1``) run from a zero state and are not
        written."""
        kn = self.kernels
        if not kn.prefill:
            return None
        from pallas_kernels.arena_prefill import recurrent_prefill

        sp = self.spec
        h = self.state_handles

        def rule(q, k, v, g, beta, *, use_qk_l2norm: bool):
            o, buf = recurrent_prefill(
                q, k, v, g, beta, self.buffer, self._kernel_table(), jnp.where(h >= 0, h, -1),
                state_offset=sp.state_offset + gi * sp.state_words, num_tokens=num_tokens,
                use_qk_l2norm=use_qk_l2norm, zero_state=self.lengths <= 0,
                interpret=kn.interpret,
            )  # fmt: skip
            return o, dataclasses.replace(self, buffer=buf)

        return rule

    def commit_gdn_state(self, gi: int, tc: TreeCache, path, path_len) -> ArenaCache | None:
        """GDN layer ``gi``'s recurrent state after the accepted ``path``, committed in place
        (:func:`pallas_kernels.arena.tree_commit`, the arena aliased); ``None`` on the XLA
        path. The conv state is left to the caller."""
        kn = self.kernels
        if not kn.gdn or not kn.takes(tc.u.shape[1], "GDN tree commit"):
            return None
        from pallas_kernels import arena as pa

        sp = self.spec
        buf = pa.tree_commit(
            self.buffer, self._kernel_table(), self._kernel_handles(), tc.k, tc.u, tc.g_path,
            path, path_len, state_offset=sp.state_offset + gi * sp.state_words,
            use_qk_l2norm=tc.qk_l2norm, interpret=kn.interpret,
        )  # fmt: skip
        return dataclasses.replace(self, buffer=buf)

    # ---------------------------------------------------------------------------- attention

    def _block(self, ai: int, kv: int) -> int:
        """Word offset of attention layer ``ai``'s K (``kv=0``) or V (1) inside a page."""
        sp = self.spec
        return sp.kv_offset + (2 * ai + kv) * sp.page_size * sp.token_words

    def write_kv(self, ai, positions, k, v, valid) -> ArenaCache:
        """``k, v [B, T, Hkv, D]`` of attention layer ``ai`` at token ``positions [B, T]``
        where ``valid`` (positions past the page table or on unmapped pages are dropped)."""
        sp = self.spec
        mp = self.page_handles.shape[1]
        logical = positions // sp.page_size
        h = jnp.take_along_axis(self.page_handles, jnp.clip(logical, 0, mp - 1), axis=1)
        seg, word = self._lookup(h, valid & (logical < mp) & (h >= 0))
        word = word + (positions % sp.page_size) * sp.token_words
        n = seg.size
        buf = self.buffer
        for kv, x in ((0, k), (1, v)):
            rows = _to_words(x.astype(sp.kv_dtype).reshape(n, -1), n)
            buf = scatter_windows(
                buf, seg.reshape(n), (word + self._block(ai, kv)).reshape(n), rows
            )
        return dataclasses.replace(self, buffer=buf)

    def committed_kv(self, ai: int, kv_len: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Attention layer ``ai``'s K and V of every row's pages: ``[B, MP * S, Hkv, D]`` (the
        XLA path's gather), positions ``>= kv_len`` zeroed."""
        sp = self.spec
        h = self.page_handles
        b, mp = h.shape
        seg, word = self._lookup(h, h >= 0)
        words = sp.page_size * sp.token_words
        shape = (sp.page_size, sp.kv_heads, sp.head_dim)
        out = []
        for kv in (0, 1):
            raw = gather_windows(self.buffer, seg, word + self._block(ai, kv), words)
            x = _from_words(raw, shape, sp.kv_dtype).reshape(
                b, mp * sp.page_size, sp.kv_heads, sp.head_dim
            )
            seen = jnp.arange(mp * sp.page_size)[None, :] < kv_len[:, None]
            out.append(jnp.where(seen[:, :, None, None], x, jnp.zeros((), x.dtype)))
        return out[0], out[1]

    def _paged_kernel_misfit(self, q: jax.Array) -> str | None:
        """Why :func:`pallas_kernels.arena_attention.paged_attention` cannot take queries of
        this (static) shape, or ``None``."""
        sp = self.spec
        if q.ndim != 4 or q.shape[3] != sp.head_dim or q.shape[2] % sp.kv_heads:
            return (f"queries {q.shape} are not [B, T, Hq, {sp.head_dim}] with Hq a multiple "
                    f"of {sp.kv_heads} KV heads")  # fmt: skip
        if jnp.dtype(q.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            return f"queries are {q.dtype}, not float32, bfloat16 or float16"
        return None

    def attention(
        self, ai, q, kv_len, q_pos, *, scale, draft_k=None, draft_v=None, draft_mask=None
    ) -> jax.Array:
        """Same as :func:`gdn_jax.models.tree_attention.paged_attention` over the arena.

        With the attention kernel selected, the pages are read in place: with draft K/V (the
        tree verify, whose queries all sit at or after the committed keys, so the causal bound
        is ``kv_len``) by :func:`pallas_kernels.arena_attention.tree_attention`, without (decode,
        prefill: the new tokens' K/V already written) by
        :func:`pallas_kernels.arena_attention.paged_attention`, causal in ``q_pos``. Queries of
        a shape that kernel does not take go to XLA (a ``ValueError`` when ``strict``)."""
        sp = self.spec
        kn = self.kernels
        if draft_k is not None and kn.attention and kn.takes(draft_k.shape[1], "tree attention"):
            from pallas_kernels.arena_attention import tree_attention

            return tree_attention(
                q, self.buffer, self._kernel_table(), self.page_handles, kv_len,
                draft_k.astype(sp.kv_dtype), draft_v.astype(sp.kv_dtype), draft_mask, layer=ai,
                kv_offset=sp.kv_offset, page_size=sp.page_size, kv_dtype=sp.kv_dtype,
                scale=float(scale), interpret=kn.interpret,
            )  # fmt: skip
        if draft_k is None and kn.attention:
            misfit = self._paged_kernel_misfit(q)
            if misfit is not None and kn.strict:
                raise ValueError(f"kernels='pallas': the arena paged attention kernel: {misfit}")
            if misfit is None:
                from pallas_kernels.arena_attention import paged_attention

                return paged_attention(
                    q, self.buffer, self._kernel_table(), self.page_handles, kv_len, q_pos,
                    layer=ai, kv_offset=sp.kv_offset, page_size=sp.page_size,
                    kv_heads=sp.kv_heads, kv_dtype=sp.kv_dtype, scale=float(scale),
                    interpret=kn.interpret,
                )  # fmt: skip
        k, v = self.committed_kv(ai, kv_len)
        j = jnp.arange(k.shape[1])
        mask = (j[None, None, :] < kv_len[:, None, None]) & (j[None, None, :] <= q_pos[:, :, None])
        if draft_k is not None:
            k = jnp.concatenate([k, draft_k.astype(k.dtype)], axis=1)
            v = jnp.concatenate([v, draft_v.astype(v.dtype)], axis=1)
            mask = jnp.concatenate([mask, draft_mask], axis=2)
        return attend(q, k, v, mask, scale)

    def with_lengths(self, lengths: jax.Array) -> ArenaCache:
        return dataclasses.replace(self, lengths=lengths)

    # ------------------------------------------------------------------ speculative scratch

    def _stash_fields(self) -> dict[str, Field]:
        if not self.spec.stash:
            raise ValueError("arena cache: the spec has no stash fields (ArenaSpec.from_layout)")
        return {f.name: f for f in self.spec.stash}

    def write_tree_state(self, tree: TreeState, scratch: jax.Array) -> ArenaCache:
        """``tree`` (what :func:`gdn_jax.models.steps.verify_tree` returned) written into each
        row's speculative-scratch units, in place when the buffer is donated.

        ``scratch``: ``int32 [B]`` ``stash`` handles (tree WY: ``tree.gdn`` holds
        :class:`TreeCache` s) or ``int32 [B, N]`` ``snapshot`` handles (one per node; the
        snapshot method: ``tree.gdn`` holds per-node states); ``-1`` for padding rows, whose
        writes are dropped. Stash: one windowed scatter per field (``u``, ``k``, ``g``, ``x``,
        ``dk``, ``dv``: all layers and nodes of a row at once; a tree of fewer than
        ``spec_nodes`` nodes fills the first nodes). Snapshot: per node, its states of every GDN
        layer into ``recurrent``, and its pre-conv inputs then draft K and V packed at the start
        of ``conv`` (:meth:`ArenaSpec.snapshot_packing`)."""
        sp = self.spec
        lg, la = sp.gdn_layers, sp.attn_layers
        seg, word = self._lookup(scratch, scratch >= 0)
        b = scratch.shape[0]
        draft_k = tree.draft_k if la else None
        draft_v = tree.draft_v if la else None
        buf = self.buffer
        if scratch.ndim == 1:  # one stash unit per row
            f = self._stash_fields()
            n = tree.conv_in.shape[2] if lg else draft_k.shape[2]
            if n > sp.spec_nodes:
                raise ValueError(
                    f"arena scratch: a tree of {n} nodes does not fit a stash unit of "
                    f"{sp.spec_nodes} nodes (layout spec_nodes)"
                )

            def rows(x, node_axis):  # [B, ...] with the node axis padded to spec_nodes
                pad = [(0, 0)] * x.ndim
                pad[node_axis] = (0, sp.spec_nodes - n)
                return jnp.pad(x, pad) if n < sp.spec_nodes else x

            parts = []
            if lg:
                parts += [
                    ("u", rows(jnp.stack([tc.u for tc in tree.gdn], 1), 2)),
                    ("k", rows(jnp.stack([tc.k for tc in tree.gdn], 1), 2)),
                    ("g", rows(jnp.stack([tc.g_path for tc in tree.gdn], 1), 2)),
                    ("x", rows(jnp.swapaxes(tree.conv_in, 0, 1), 2)),
                ]
            if la:
                parts += [
                    ("dk", rows(jnp.swapaxes(draft_k, 0, 1), 2)),
                    ("dv", rows(jnp.swapaxes(draft_v, 0, 1), 2)),
                ]
            for name, x in parts:
                fld = f[name]
                buf = scatter_windows(buf, seg, word + fld.word_offset, _pack(x, b, fld.dtype))
            return dataclasses.replace(self, buffer=buf)
        # snapshot: one unit per node
        n = scratch.shape[1]
        m = b * n
        seg, word = seg.reshape(m), word.reshape(m)
        if lg:
            states = jnp.stack(tree.gdn, 2)  # [B, N, Lg, Hv, K, V]
            buf = scatter_windows(
                buf, seg, word + sp.state_offset, _pack(states, m, sp.state_dtype)
            )
        sp.snapshot_packing()  # raises when a node's conv inputs and draft K/V do not fit
        packed = []
        if lg:  # [Lg, B, N, C] -> [B*N, Lg*C]
            packed.append(_pack(jnp.moveaxis(tree.conv_in, 0, 2), m, sp.conv_dtype))
        if la:
            for d in (draft_k, draft_v):  # [La, B, N, Hkv, D] -> [B*N, La*Hkv*D]
                packed.append(_pack(jnp.moveaxis(d, 0, 2), m, sp.kv_dtype))
        buf = scatter_windows(buf, seg, word + sp.conv_offset, jnp.concatenate(packed, axis=1))
        return dataclasses.replace(self, buffer=buf)

    def read_tree_state(
        self, scratch: jax.Array, path: jax.Array, path_len: jax.Array, *, qk_l2norm: bool
    ) -> TreeState:
        """The :class:`TreeState` that :meth:`write_tree_state` stored in ``scratch`` (same
        handles), as :func:`gdn_jax.models.steps.commit` reads it; bit for bit in the storage
        dtypes (the model's own in the engine: ``layout_for(..., kv_dtype=dtype)``, conv
        ``dtype``), ``u``, ``g`` and the snapshot states f32.

        Stash: every field of each row's unit (one windowed gather per field), the tree of
        ``spec_nodes`` nodes (a smaller tree's padding nodes are never on a path). The
        :class:`TreeCache` s' ``parents`` are not stored (the commit does not read them on
        device): all ``-1``; ``qk_l2norm`` is static. Snapshot: only the accepted leaf's unit's
        ``recurrent`` (``path[b, path_len[b]-1]``; :func:`gdn_jax.snapshot_tree_commit` takes
        that leaf from a one-node ``[B, 1, Hv, K, V]`` per layer, as it clips the node id), and
        every node's packed pre-conv inputs and draft K/V."""
        sp = self.spec
        lg, la = sp.gdn_layers, sp.attn_layers
        b = scratch.shape[0]
        md = sp.model_dtype
        empty = jnp.zeros((0,), jnp.float32)
        if scratch.ndim == 1:
            f = self._stash_fields()
            seg, word = self._lookup(scratch, scratch >= 0)

            def field(name, dtype):
                fld = f[name]
                raw = gather_windows(self.buffer, seg, word + fld.word_offset, fld.words)
                return _unpack(raw, fld.shape, fld.dtype).astype(dtype)  # [B, L, N, ...]

            gdn, conv_in, dk, dv = (), empty, empty, empty
            if lg:
                u, k, g = field("u", jnp.float32), field("k", md), field("g", jnp.float32)
                parents = jnp.full((b, sp.spec_nodes), -1, jnp.int32)
                gdn = tuple(
                    TreeCache(u[:, i], k[:, i], g[:, i], parents, qk_l2norm) for i in range(lg)
                )
                conv_in = jnp.swapaxes(field("x", md), 0, 1)
            if la:
                dk = jnp.swapaxes(field("dk", md), 0, 1)
                dv = jnp.swapaxes(field("dv", md), 0, 1)
            return TreeState(gdn, conv_in, dk, dv)
        n = scratch.shape[1]
        gdn, conv_in, dk, dv = (), empty, empty, empty
        if lg:
            last = jnp.take_along_axis(path, jnp.maximum(path_len - 1, 0)[:, None], axis=1)
            leaf = jnp.take_along_axis(scratch, jnp.clip(last, 0, n - 1), axis=1)[:, 0]
            seg, word = self._lookup(leaf, leaf >= 0)
            raw = gather_windows(self.buffer, seg, word + sp.state_offset, lg * sp.state_words)
            states = _unpack(raw, (lg, *sp.state_shape), sp.state_dtype).astype(jnp.float32)
            gdn = tuple(states[:, i, None] for i in range(lg))  # [B, 1, Hv, K, V]
        xw, kw, vw = sp.snapshot_packing()  # (0 words for a kind of layer the model lacks)
        seg, word = self._lookup(scratch, scratch >= 0)  # [B, N]
        raw = gather_windows(self.buffer, seg, word + sp.conv_offset, xw + kw + vw)
        if lg:  # [B, N, Lg, C] -> [Lg, B, N, C]
            x = _unpack(raw[..., :xw], (lg, sp.conv_shape[1]), sp.conv_dtype)
            conv_in = jnp.moveaxis(x.astype(md), 2, 0)
        if la:  # [B, N, La, Hkv, D] -> [La, B, N, Hkv, D]
            shape = (la, sp.kv_heads, sp.head_dim)
            dk = jnp.moveaxis(_unpack(raw[..., xw : xw + kw], shape, sp.kv_dtype), 2, 0)
            dv = jnp.moveaxis(_unpack(raw[..., xw + kw :], shape, sp.kv_dtype), 2, 0)
            dk, dv = dk.astype(md), dv.astype(md)
        return TreeState(gdn, conv_in, dk, dv)


jax.tree_util.register_dataclass(
    ArenaCache,
    data_fields=["buffer", "table", "state_handles", "page_handles", "lengths"],
    meta_fields=["spec", "kernels"],
)
