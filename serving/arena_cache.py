"""The model's cache stored in the memory manager's arena, read and written through its handles.

:class:`ArenaCache` implements :class:`gdn_jax.models.cache_protocol.StepCache`, the contract
the step functions of :mod:`gdn_jax.models.steps` call, but holds no cache array of its own:
only the arena buffer (``uint32 [segments, segment_words]``, donated by the jitted steps so
every write is in place), the device handle table (``int32 [H, 2]``: handle -> ``(segment,
word)``, :meth:`MemoryManager.device_table`), each row's ``state`` handle and its page table of
``kv`` handles. Inside the jitted step every access goes handle -> table -> ``(segment, word)``
-> the field's word offset (static, :class:`serving.arena_spec.ArenaSpec`):

- GDN layer ``gi`` of a row: one window of the row's state unit, ``recurrent[gi]`` (f32,
  ``Hv*K*V`` words) and ``conv[gi]`` (``(W-1)*C`` elements bitcast from words), read with a
  windowed gather over the batch rows (:func:`serving.memory.arena.gather_windows`, what
  ``vmap`` of :func:`serving.memory.view`'s ``dynamic_slice`` + bitcast lowers to) and written
  back with a windowed scatter (:func:`serving.memory.arena.scatter_windows`) into the arena;
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
``[B, pages * S, Hkv, D]`` temporary per layer (as
:func:`gdn_jax.models.tree_attention.gather_pages` does for the pooled path), and its GDN
verify / commit gather each layer's state window (no copy of the whole state).

The in-place hooks of the protocol (``gdn_tree_rule``, ``gdn_step_rule``, ``gdn_prefill_rule``,
``commit_gdn_state``) and :meth:`ArenaCache.attention` run the Pallas kernels that ``kernels``
(:class:`serving.kernels.ArenaKernels`) selects, reading the arena in place through the table;
the hooks return ``None`` (the default XLA windows) for the parts it leaves on XLA. Always XLA
windows: the conv state outside the decode rule (``(W-1)*C`` elements per layer), the K/V
writes (decode's and prefill's new tokens, the accepted nodes'), the snapshot verify method
and the speculative scratch's writes and reads (the commit kernel gets the stash's ``k, u, g`` read out by XLA
windows). Rows at length 0 read zero states on both paths; a commit of a length-0 row (which
the engine never issues: it verifies only prefilled requests) leaves that row's recurrent
state unwritten on the kernel path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax import TreeCache
from gdn_jax.models.cache import TreeState
from gdn_jax.models.cache_protocol import SequenceRule, TreeRule
from gdn_jax.models.tree_attention import attend_committed
from serving.arena_spec import ArenaSpec
from serving.kernels import XLA_KERNELS, ArenaKernels
from serving.memory.arena import field_to_words, gather_windows, scatter_windows, words_to_field
from serving.memory.layout import Field


@dataclasses.dataclass(frozen=True)
class ArenaCache:
    """A batch's cache inside the arena (module docstring); a
    :class:`gdn_jax.models.cache_protocol.StepCache`. ``state_handles int32 [B]`` (``-1``:
    padding row), ``page_handles int32 [B, MP]`` (``-1``: unmapped), ``lengths int32 [B]``
    committed tokens. A pytree; ``spec`` and ``kernels`` are static."""

    buffer: jax.Array
    table: jax.Array
    state_handles: jax.Array
    page_handles: jax.Array
    lengths: jax.Array
    spec: ArenaSpec
    kernels: ArenaKernels = XLA_KERNELS
    # with ``defer`` the windowed writes wait in ``pending`` (``(segment, word, rows)``
    # triples) until :meth:`flush`; reads see the buffer as it was before them
    pending: tuple = ()
    defer: bool = False

    @property
    def _oob(self) -> int:
        return self.buffer.shape[0]

    def _write(self, seg: jax.Array, word: jax.Array, rows: jax.Array) -> ArenaCache:
        """One windowed scatter (:func:`scatter_windows`), or queued when ``defer``."""
        if self.defer:
            return dataclasses.replace(self, pending=(*self.pending, (seg, word, rows)))
        return dataclasses.replace(self, buffer=scatter_windows(self.buffer, seg, word, rows))

    def flush(self, *after):
        """The queued writes applied, after every read of the buffer so far: the cache, or
        ``(cache, after)`` when given ``after``, values computed from reads that are not among
        the written ones (a verify's logits: the last layer's reads feed only them), passed
        through the same barrier so their reads are ordered before the writes too.

        A program that reads the arena, computes and writes its results back (a commit, a
        verify writing its scratch) would otherwise interleave each layer's reads with the
        previous layer's writes: XLA then cannot prove a read runs before the write that
        updates the buffer in place and copies the whole arena before that write. Queued
        writes go behind one ``optimization_barrier`` over the buffer and every written value,
        so all reads of the buffer are ordered before the first write and each write is in
        place."""
        if not self.pending:
            return (self, after) if after else self
        buf, pending, after_ = jax.lax.optimization_barrier((self.buffer, self.pending, after))
        for seg, word, rows in pending:
            buf = scatter_windows(buf, seg, word, rows)
        cache = dataclasses.replace(self, buffer=buf, pending=())
        return (cache, after_) if after else cache

    def _no_pending(self, what: str) -> None:
        if self.pending:
            raise ValueError(f"arena cache: {what} would not see the queued writes; flush() first")

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
        return words_to_field(conv, sp.conv_shape, sp.conv_dtype).astype(sp.model_dtype)

    def gdn_state(self, gi: int) -> tuple[jax.Array, jax.Array]:
        """``(conv [B, W-1, C] model dtype, ssm [B, Hv, K, V] f32)`` of GDN layer ``gi``."""
        sp = self.spec
        seg, word = self._state_lookup(fresh=True)
        ssm = gather_windows(
            self.buffer, seg, word + sp.state_offset + gi * sp.state_words, sp.state_words
        )
        ssm = words_to_field(ssm, sp.state_shape, sp.state_dtype).astype(jnp.float32)
        return self.gdn_conv_state(gi), ssm

    def with_gdn_conv_state(self, gi: int, conv: jax.Array) -> ArenaCache:
        sp = self.spec
        seg, word = self._state_lookup(fresh=False)
        return self._write(
            seg,
            word + sp.conv_offset + gi * sp.conv_words,
            field_to_words(conv.astype(sp.conv_dtype), seg.shape[0]),
        )

    def with_gdn_state(self, gi: int, conv: jax.Array, ssm: jax.Array) -> ArenaCache:
        sp = self.spec
        seg, word = self._state_lookup(fresh=False)
        if not self.defer:
            # the new states are computed from reads of this buffer: behind one barrier with
            # it, every such read runs before the two writes, which then update it in place
            # (else XLA may fuse a read into the second write, after the first one, and copy
            # the whole arena to keep the value it reads)
            buf, conv, ssm = jax.lax.optimization_barrier((self.buffer, conv, ssm))
            self = dataclasses.replace(self, buffer=buf)
        cache = self._write(
            seg,
            word + sp.state_offset + gi * sp.state_words,
            field_to_words(ssm.astype(sp.state_dtype), seg.shape[0]),
        )
        return cache.with_gdn_conv_state(gi, conv)

    # ------------------------------------------------------------ in-place kernels (Pallas)

    def _kernel_table(self) -> jax.Array:
        """The table as the kernels get it: a padding row reads through ``table[0]``, which is
        ``(-1, -1)`` while handle 0 is free, so clamp to an in-bounds (ignored) address."""
        return jnp.maximum(self.table, 0)

    def _kernel_handles(self, *, fresh: bool) -> jax.Array:
        """State handles for the GDN kernels: ``-1`` (a zero state, never written) for padding
        rows and, with ``fresh``, for rows at length 0, as the XLA path reads them."""
        h = self.state_handles
        ok = (h >= 0) & (self.lengths > 0) if fresh else h >= 0
        return jnp.where(ok, h, -1)

    def _gdn_kernel_args(self, gi: int, *, fresh: bool) -> dict:
        """The arena arguments of the GDN kernels for layer ``gi`` (``fresh``: see
        :meth:`_kernel_handles`)."""
        sp = self.spec
        return dict(
            arena=self.buffer,
            table=self._kernel_table(),
            handles=self._kernel_handles(fresh=fresh),
            state_offset=sp.state_offset + gi * sp.state_words,
            interpret=self.kernels.interpret,
        )

    def gdn_tree_rule(self, gi: int, n: int) -> TreeRule | None:
        """The tree-verify rule of GDN layer ``gi`` for ``n`` nodes reading its recurrent state
        in place (:func:`pallas_kernels.verify.arena.tree_verify`): ``rule(q, k, v, g, beta,
        parents, *, use_qk_l2norm) -> (o, TreeCache)``; ``None`` on the XLA path (then
        :meth:`gdn_state` gives the state)."""
        kn = self.kernels
        if not kn.gdn or not kn.takes(n, "GDN tree verify"):
            return None
        if kn.tpu:
            return self._tpu_tree_rule(gi)
        from gdn_jax.pallas_routes import verify_blocks_for
        from pallas_kernels.verify import arena as verify_arena

        def rule(q, k, v, g, beta, parents, *, use_qk_l2norm: bool):
            blocks = verify_blocks_for(q, k, v, kn.interpret)
            o, u, g_path = verify_arena.tree_verify(
                q,
                k,
                v,
                g,
                beta,
                parents,
                **self._gdn_kernel_args(gi, fresh=True),
                use_qk_l2norm=use_qk_l2norm,
                blocks=blocks,
            )
            return o, TreeCache(u, k, g_path, parents.astype(jnp.int32), use_qk_l2norm)

        return rule

    def _tpu_tree_rule(self, gi: int) -> TreeRule:
        """:meth:`gdn_tree_rule` on the TPU kernel (:func:`pallas_kernels.tpu.tree_verify_arena`)."""
        from pallas_kernels.tpu import tree_verify_arena

        def rule(q, k, v, g, beta, parents, *, use_qk_l2norm: bool):
            o, u, g_path = tree_verify_arena(
                q,
                k,
                v,
                g,
                beta,
                parents,
                **self._gdn_kernel_args(gi, fresh=True),
                use_qk_l2norm=use_qk_l2norm,
            )
            return o, TreeCache(u, k, g_path, parents.astype(jnp.int32), use_qk_l2norm)

        return rule

    def _plain_step_rule(self, gi: int, kernel) -> SequenceRule:
        """:meth:`gdn_step_rule`'s plain form on ``kernel`` (the GPU
        :func:`pallas_kernels.decode.arena.recurrent_step` or the TPU
        :func:`pallas_kernels.tpu.recurrent_step_arena`, one signature)."""

        def rule(q, k, v, g, beta, *, use_qk_l2norm: bool):
            o, buf = kernel(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                g[:, 0],
                beta[:, 0],
                **self._gdn_kernel_args(gi, fresh=False),
                use_qk_l2norm=use_qk_l2norm,
                zero_state=self.lengths <= 0,
            )
            return o[:, None], dataclasses.replace(self, buffer=buf)

        return rule

    def gdn_step_rule(self, gi: int) -> SequenceRule | None:
        """The one-token (decode) rule of GDN layer ``gi`` reading and writing its recurrent
        state in place (:func:`pallas_kernels.decode.arena.recurrent_step`, the arena aliased):
        ``rule(q, k, v, g, beta, *, use_qk_l2norm) -> (o [B, 1, Hv, V], ArenaCache)`` on
        ``[B, 1, ...]`` inputs, the returned cache holding the updated arena; ``None`` unless
        the decode kernel is selected (then :meth:`gdn_state` / :meth:`with_gdn_state`).
        The rule's ``raw`` form takes the conv's output channels and the gates' projections
        (:func:`pallas_kernels.decode.arena.recurrent_step_mixed`), and its ``conv`` form (a
        bf16 or f32 conv state in the model's dtype) also runs the conv on the conv window in
        place first (:func:`pallas_kernels.decode.conv.conv_step`): the model takes the
        latter (:meth:`gdn_jax.models.gdn.GatedDeltaNet.__call__`). Where ``conv_norm`` is set
        (``kernels.decode_norm``), the conv form also takes the layer's gated RMSNorm
        (``norm=(weight, eps, z, z_col)``) and returns its output, the norm applied by the
        step kernel.

        As the XLA path: rows at length 0 start from a zero state and are written; padding rows
        (handle ``-1``) run from a zero state and are not written."""
        kn = self.kernels
        if not kn.decode:
            return None
        if kn.tpu:  # the plain form only: the model forms q, k, v and the gates, XLA the conv
            from pallas_kernels.tpu import recurrent_step_arena

            return self._plain_step_rule(gi, recurrent_step_arena)
        from pallas_kernels.decode.arena import recurrent_step, recurrent_step_mixed
        from pallas_kernels.decode.conv import conv_step

        rule = self._plain_step_rule(gi, recurrent_step)

        def step_mixed(
            cache, mixed, a, b, a_log, dt_bias, *, num_tokens, use_qk_l2norm, a_col=0, b_col=0,
            norm=None,
        ):  # fmt: skip
            # the step on the layer's raw inputs in ``cache``'s arena: the kernel splits the
            # conv's channels and forms the gates itself (two XLA kernels fewer per layer)
            hv, dk, dv = self.spec.state_shape
            o, buf = recurrent_step_mixed(
                mixed[:, 0],
                a[:, 0],
                b[:, 0],
                a_log,
                dt_bias,
                **cache._gdn_kernel_args(gi, fresh=False),
                num_k_heads=(mixed.shape[-1] - hv * dv) // (2 * dk),
                head_k_dim=dk,
                use_qk_l2norm=use_qk_l2norm,
                zero_state=cache.lengths <= 0,
                live=None if num_tokens is None else num_tokens > 0,
                a_col=a_col,
                b_col=b_col,
                **({} if norm is None else norm_args(norm)),
            )
            return o[:, None], dataclasses.replace(cache, buffer=buf)

        def raw(mixed, a, b, a_log, dt_bias, *, num_tokens=None, use_qk_l2norm: bool):
            return step_mixed(
                self,
                mixed,
                a,
                b,
                a_log,
                dt_bias,
                num_tokens=num_tokens,
                use_qk_l2norm=use_qk_l2norm,
            )

        def norm_args(norm):
            weight, eps, z, z_col = norm
            return dict(norm_weight=weight, z=z[:, 0], z_col=z_col, norm_eps=eps)

        def conv(
            qkv, weight, a, b, a_log, dt_bias, *, num_tokens=None, use_qk_l2norm: bool, cols=None,
            norm=None,
        ):  # fmt: skip
            # the conv too: its window read, updated and written in place by one kernel;
            # ``cols = (qkv, a, b)``: the columns where each starts in its (fused) array
            qkv_col, a_col, b_col = cols or (0, 0, 0)
            sp, args = self.spec, self._gdn_kernel_args(gi, fresh=False)
            y, buf = conv_step(
                qkv[:, 0],
                weight,
                args["arena"],
                args["table"],
                args["handles"],
                conv_offset=sp.conv_offset + gi * sp.conv_words,
                state_dtype=sp.conv_dtype,
                zero_state=self.lengths <= 0,
                live=None if num_tokens is None else num_tokens > 0,
                x_col=qkv_col,
                interpret=args["interpret"],
            )
            after = dataclasses.replace(self, buffer=buf)
            return step_mixed(
                after, y[:, None], a, b, a_log, dt_bias, num_tokens=num_tokens,
                use_qk_l2norm=use_qk_l2norm, a_col=a_col, b_col=b_col, norm=norm,
            )  # fmt: skip

        rule.raw = raw
        sp = self.spec
        if jnp.dtype(sp.conv_dtype) == jnp.dtype(sp.model_dtype) and jnp.dtype(sp.conv_dtype) in (
            jnp.dtype(jnp.bfloat16),
            jnp.dtype(jnp.float32),
        ):
            rule.conv = conv
            # conv(..., norm=(weight [V], eps, z [B, 1, >= z_col + Hv V], z_col)) returns the
            # gated norm's output (the norm inside the step kernel)
            rule.conv_norm = kn.decode_norm
        return rule

    def gdn_prefill_rule(self, gi: int, num_tokens: jax.Array) -> SequenceRule | None:
        """The prefill rule of GDN layer ``gi`` (``T > 1`` tokens per row, the first
        ``num_tokens[b]`` of row ``b`` live) reading its initial recurrent state and writing the
        final one in place, the arena aliased: by
        :func:`pallas_kernels.decode.arena.recurrent_prefill`, or on the TPU kernels
        (``kernels.tpu``) by the chunked :func:`pallas_kernels.tpu.chunk_prefill_arena`.
        ``rule(q, k, v, g, beta, *, use_qk_l2norm) -> (o [B, T, Hv, V], ArenaCache)``, the
        returned cache holding the updated arena; ``None`` unless the prefill kernel is
        selected (then :meth:`gdn_state` / :meth:`with_gdn_state`).

        As the XLA path: rows at length 0 start from a zero state and are written (also with
        no live token); padding rows (handle ``-1``) run from a zero state and are not
        written."""
        kn = self.kernels
        if not kn.prefill:
            return None
        if kn.tpu:
            from pallas_kernels.tpu import chunk_prefill_arena as kernel
        else:
            from pallas_kernels.decode.arena import recurrent_prefill as kernel

        def rule(q, k, v, g, beta, *, use_qk_l2norm: bool):
            o, buf = kernel(
                q,
                k,
                v,
                g,
                beta,
                **self._gdn_kernel_args(gi, fresh=False),
                num_tokens=num_tokens,
                use_qk_l2norm=use_qk_l2norm,
                zero_state=self.lengths <= 0,
            )
            return o, dataclasses.replace(self, buffer=buf)

        return rule

    def commit_gdn_state(
        self, gi: int, tc: TreeCache, path: jax.Array, path_len: jax.Array
    ) -> ArenaCache | None:
        """GDN layer ``gi``'s recurrent state after the accepted ``path``, committed in place
        (:func:`pallas_kernels.commit.arena.tree_commit`, the arena aliased); ``None`` on the
        XLA path. The conv state is left to the caller."""
        kn = self.kernels
        if not kn.gdn or not kn.takes(tc.u.shape[1], "GDN tree commit"):
            return None
        if kn.tpu:
            from pallas_kernels.tpu import tree_commit_arena as commit
        else:
            from pallas_kernels.commit.arena import tree_commit as commit

        buf = commit(
            **self._gdn_kernel_args(gi, fresh=True),
            k=tc.k,
            u=tc.u,
            g_path=tc.g_path,
            path=path,
            path_len=path_len,
            use_qk_l2norm=tc.qk_l2norm,
        )
        return dataclasses.replace(self, buffer=buf)

    # ---------------------------------------------------------------------------- attention

    def _block(self, ai: int, kv: int) -> int:
        """Word offset of attention layer ``ai``'s K (``kv=0``) or V (1) inside a page."""
        sp = self.spec
        return sp.kv_offset + (2 * ai + kv) * sp.page_size * sp.token_words

    def write_kv(
        self, ai: int, positions: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array
    ) -> ArenaCache:
        """``k, v [B, T, Hkv, D]`` of attention layer ``ai`` at token ``positions [B, T]``
        where ``valid`` (positions past the page table or on unmapped pages are dropped)."""
        sp = self.spec
        mp = self.page_handles.shape[1]
        logical = positions // sp.page_size
        h = jnp.take_along_axis(self.page_handles, jnp.clip(logical, 0, mp - 1), axis=1)
        seg, word = self._lookup(h, valid & (logical < mp) & (h >= 0))
        word = word + (positions % sp.page_size) * sp.token_words
        n = seg.size
        cache = self
        for kv, x in ((0, k), (1, v)):
            rows = field_to_words(x.astype(sp.kv_dtype), n)
            cache = cache._write(seg.reshape(n), (word + self._block(ai, kv)).reshape(n), rows)
        return cache

    def attention_decode_rule(self, ai: int):
        """With ``kernels.attention_decode`` (:data:`serving.kernels.ATTENTION_DECODE_KERNEL`)
        and no writes queued: attention layer ``ai``'s decode step from its fused projection
        output by :func:`pallas_kernels.attention.prep.attention_decode_prep` (head norms,
        rotary embedding, the token's K/V written into the pages in place); else None (the
        model's projection, then :meth:`write_kv`). A layer the kernel does not take gets None
        from the rule (a ``ValueError`` when ``strict``)."""
        kn, sp = self.kernels, self.spec
        if not kn.attention_decode or self.defer:
            return None

        def rule(proj, positions, valid, **layer):
            from pallas_kernels.attention.prep import attention_decode_prep, check_prep

            table = self._kernel_table()
            kw = dict(
                num_heads=layer["num_heads"],
                kv_heads=sp.kv_heads,
                head_dim=layer["head_dim"],
                rotary_dim=layer["rotary_dim"],
                gated=layer["gated"],
                kv_dtype=sp.kv_dtype,
                page_size=sp.page_size,
            )
            try:
                if layer["head_dim"] != sp.head_dim:
                    raise ValueError(
                        f"head_dim: {layer['head_dim']} is not the arena's {sp.head_dim}"
                    )
                check_prep(
                    proj, layer["q_norm"], layer["k_norm"], positions, valid, self.buffer, table,
                    self.page_handles, **kw,
                )  # fmt: skip
            except ValueError as e:
                if kn.strict:
                    raise ValueError(f"kernels='pallas': the attention decode kernel: {e}") from e
                return None
            q, buf = attention_decode_prep(
                proj, layer["q_norm"], layer["k_norm"], positions, valid, self.buffer, table,
                self.page_handles, theta=layer["theta"], eps=layer["eps"], layer=ai,
                kv_offset=sp.kv_offset, interpret=kn.interpret, **kw,
            )  # fmt: skip
            return q, dataclasses.replace(self, buffer=buf)

        return rule

    def committed_kv(self, ai: int, kv_len: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Attention layer ``ai``'s K and V of every row's pages: ``[B, MP * S, Hkv, D]`` (the
        XLA path's gather), positions ``>= kv_len`` zeroed."""
        self._no_pending("reading the KV pages")
        sp = self.spec
        h = self.page_handles
        b, mp = h.shape
        seg, word = self._lookup(h, h >= 0)
        words = sp.page_size * sp.token_words
        shape = (sp.page_size, sp.kv_heads, sp.head_dim)
        out = []
        for kv in (0, 1):
            raw = gather_windows(self.buffer, seg, word + self._block(ai, kv), words)
            x = words_to_field(raw, shape, sp.kv_dtype).reshape(
                b, mp * sp.page_size, sp.kv_heads, sp.head_dim
            )
            seen = jnp.arange(mp * sp.page_size)[None, :] < kv_len[:, None]
            out.append(jnp.where(seen[:, :, None, None], x, jnp.zeros((), x.dtype)))
        return out[0], out[1]

    def _paged_kernel_misfit(self, q: jax.Array) -> str | None:
        """Why :func:`pallas_kernels.attention.arena.paged_attention` cannot take queries of
        this (static) shape, or ``None``."""
        sp = self.spec
        if q.ndim != 4 or q.shape[3] != sp.head_dim or q.shape[2] % sp.kv_heads:
            return (
                f"queries {q.shape} are not [B, T, Hq, {sp.head_dim}] with Hq a multiple of "
                f"{sp.kv_heads} KV heads"
            )
        if jnp.dtype(q.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            return f"queries are {q.dtype}, not float32, bfloat16 or float16"
        return None

    def _attention_kernel_args(self, ai: int) -> dict:
        """The arena arguments of the attention kernels for attention layer ``ai``."""
        sp = self.spec
        return dict(
            arena=self.buffer,
            table=self._kernel_table(),
            page_handles=self.page_handles,
            layer=ai,
            kv_offset=sp.kv_offset,
            page_size=sp.page_size,
            kv_dtype=sp.kv_dtype,
            interpret=self.kernels.interpret,
        )

    def attention(
        self,
        ai: int,
        q: jax.Array,
        kv_len: jax.Array,
        q_pos: jax.Array,
        *,
        scale: float,
        draft_k: jax.Array | None = None,
        draft_v: jax.Array | None = None,
        draft_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Same as :func:`gdn_jax.models.tree_attention.paged_attention` over the arena.

        With the attention kernel selected, the pages are read in place: with draft K/V (the
        tree verify, whose queries all sit at or after the committed keys, so the causal bound
        is ``kv_len``) by :func:`pallas_kernels.attention.arena.tree_attention` (on the TPU
        kernels :func:`pallas_kernels.tpu.tree_attention_arena`), without (decode, prefill: the
        new tokens' K/V already written) by
        :func:`pallas_kernels.attention.arena.paged_attention`, causal in ``q_pos`` (on the TPU
        kernels :func:`pallas_kernels.tpu.paged_attention_arena`). Queries of a shape that
        kernel does not take go to XLA (a ``ValueError`` when ``strict``)."""
        sp = self.spec
        kn = self.kernels
        self._no_pending("attention")
        tree = draft_k is not None and (kn.attention or kn.tpu_attention)
        if tree and kn.takes(draft_k.shape[1], "tree attention"):
            if kn.tpu_attention:
                from pallas_kernels.tpu import tree_attention_arena as tree_attention
            else:
                from pallas_kernels.attention.arena import tree_attention

            return tree_attention(
                q,
                **self._attention_kernel_args(ai),
                kv_len=kv_len,
                draft_k=draft_k.astype(sp.kv_dtype),
                draft_v=draft_v.astype(sp.kv_dtype),
                draft_mask=draft_mask,
                scale=float(scale),
            )
        if draft_k is None and kn.tpu_attention:
            from pallas_kernels.tpu import paged_attention_arena

            return paged_attention_arena(
                q,
                **self._attention_kernel_args(ai),
                kv_len=kv_len,
                q_pos=q_pos,
                kv_heads=sp.kv_heads,
                scale=float(scale),
            )
        if draft_k is None and kn.attention:
            misfit = self._paged_kernel_misfit(q)
            if misfit is not None and kn.strict:
                raise ValueError(f"kernels='pallas': the arena paged attention kernel: {misfit}")
            if misfit is None:
                from pallas_kernels.attention.arena import paged_attention

                return paged_attention(
                    q,
                    **self._attention_kernel_args(ai),
                    kv_len=kv_len,
                    q_pos=q_pos,
                    kv_heads=sp.kv_heads,
                    scale=float(scale),
                )
        k, v = self.committed_kv(ai, kv_len)
        return attend_committed(
            q,
            k,
            v,
            kv_len,
            q_pos,
            scale=scale,
            draft_k=draft_k,
            draft_v=draft_v,
            draft_mask=draft_mask,
        )

    def with_lengths(self, lengths: jax.Array) -> ArenaCache:
        return dataclasses.replace(self, lengths=lengths)

    # ------------------------------------------------------------------ speculative scratch

    def _stash_fields(self) -> dict[str, Field]:
        if not self.spec.stash:
            raise ValueError("arena cache: the spec has no stash fields (ArenaSpec.from_layout)")
        return {f.name: f for f in self.spec.stash}

    def write_snapshot_states(self, layer: int, states: jax.Array, scratch: jax.Array):
        """GDN layer ``layer``'s per-node states ``[B, N, Hv, K, V]`` (the snapshot verify)
        written into the rows' ``snapshot`` units (``scratch int32 [B, N]``, ``-1``: dropped)
        at once, not queued: :func:`gdn_jax.models.steps.verify_tree` (``snapshot_sink``)
        hands each layer's states here as it computes them and reads the later layers through
        the returned cache, so every read of the buffer comes before the writes that follow
        it, each write is in place, and one layer's states are alive at a time instead of
        every layer's (``B N Lg Hv K V`` floats: 54 GiB at Qwen3.5-35B-A3B's dims, ``B`` 32,
        ``N`` 29)."""
        if self.pending:
            raise ValueError("write_snapshot_states: queued writes must be flushed first")
        sp = self.spec
        b, n = scratch.shape
        m = b * n
        seg, word = self._lookup(scratch, scratch >= 0)
        word = word.reshape(m) + sp.state_offset + layer * sp.state_words
        rows = field_to_words(states.astype(sp.state_dtype), m)
        return dataclasses.replace(
            self, buffer=scatter_windows(self.buffer, seg.reshape(m), word, rows)
        )

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
        cache = self
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
                cache = cache._write(
                    seg, word + fld.word_offset, field_to_words(x.astype(fld.dtype), b)
                )
            return cache
        # snapshot: one unit per node
        n = scratch.shape[1]
        m = b * n
        seg, word = seg.reshape(m), word.reshape(m)
        if lg and tree.gdn[0] is not None:  # (None: written as verified, above)
            states = jnp.stack(tree.gdn, 2)  # [B, N, Lg, Hv, K, V]
            cache = cache._write(
                seg, word + sp.state_offset, field_to_words(states.astype(sp.state_dtype), m)
            )
        sp.snapshot_packing()  # raises when a node's conv inputs and draft K/V do not fit
        packed = []
        if lg:  # [Lg, B, N, C] -> [B*N, Lg*C]
            packed.append(field_to_words(jnp.moveaxis(tree.conv_in, 0, 2).astype(sp.conv_dtype), m))
        if la:
            for d in (draft_k, draft_v):  # [La, B, N, Hkv, D] -> [B*N, La*Hkv*D]
                packed.append(field_to_words(jnp.moveaxis(d, 0, 2).astype(sp.kv_dtype), m))
        return cache._write(seg, word + sp.conv_offset, jnp.concatenate(packed, axis=1))

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
                return words_to_field(raw, fld.shape, fld.dtype).astype(dtype)  # [B, L, N, ...]

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
            states = words_to_field(raw, (lg, *sp.state_shape), sp.state_dtype).astype(jnp.float32)
            gdn = tuple(states[:, i, None] for i in range(lg))  # [B, 1, Hv, K, V]
        xw, kw, vw = sp.snapshot_packing()  # (0 words for a kind of layer the model lacks)
        seg, word = self._lookup(scratch, scratch >= 0)  # [B, N]
        raw = gather_windows(self.buffer, seg, word + sp.conv_offset, xw + kw + vw)
        if lg:  # [B, N, Lg, C] -> [Lg, B, N, C]
            x = words_to_field(raw[..., :xw], (lg, sp.conv_shape[1]), sp.conv_dtype)
            conv_in = jnp.moveaxis(x.astype(md), 2, 0)
        if la:  # [B, N, La, Hkv, D] -> [La, B, N, Hkv, D]
            shape = (la, sp.kv_heads, sp.head_dim)
            dk = jnp.moveaxis(words_to_field(raw[..., xw : xw + kw], shape, sp.kv_dtype), 2, 0)
            dv = jnp.moveaxis(words_to_field(raw[..., xw + kw :], shape, sp.kv_dtype), 2, 0)
            dk, dv = dk.astype(md), dv.astype(md)
        return TreeState(gdn, conv_in, dk, dv)


jax.tree_util.register_dataclass(
    ArenaCache,
    data_fields=["buffer", "table", "state_handles", "page_handles", "lengths", "pending"],
    meta_fields=["spec", "kernels", "defer"],
)
