"""Which arena steps run on the in-place Pallas kernels: :class:`ArenaKernels`, chosen by
:func:`select_kernels` (``ArenaRunner(kernels=)``, ``LLM(kernels=)``).

With the kernels, :class:`serving.arena_cache.ArenaCache` reads the arena in place through the
handle table: the tree verify's GDN recurrent states
(:func:`pallas_kernels.verify.arena.tree_verify`), every attention layer's KV pages (the tree
verify's by :func:`pallas_kernels.attention.arena.tree_attention`, decode's and prefill's,
causal, by :func:`pallas_kernels.attention.arena.paged_attention`), the commit's recurrent
states (:func:`pallas_kernels.commit.arena.tree_commit`, the arena aliased), decode's GDN
layers (:func:`pallas_kernels.decode.conv.conv_step` and
:func:`pallas_kernels.decode.arena.recurrent_step_mixed`, the arena aliased) and, with
``kernels="pallas"`` only, prefill's GDN layers
(:func:`pallas_kernels.decode.arena.recurrent_prefill`, the arena aliased; ``kernels="auto"``
keeps XLA's chunked prefill). A geometry the kernels do not take (the misfit checks below)
stays on XLA windows, or raises with ``kernels="pallas"``. ``kernels="pallas_tpu"`` takes the
Mosaic TPU versions (:mod:`pallas_kernels.tpu`) of the GDN verify, commit, decode step and
prefill (the chunked :func:`pallas_kernels.tpu.chunk_prefill_arena`, the arena aliased) and
of the attention: decode's and prefill's (``paged_attention_arena``) and the tree verify's
(``tree_attention_arena``).

``"auto"`` takes the tree kernels up to :data:`gdn_jax.pallas_routes.AUTO_MAX_NODES` nodes
(where the dense kernels were measured faster than XLA on the H200); an explicit ``"pallas"``
up to :data:`pallas_kernels.MAX_NODES`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from serving.arena_spec import ArenaSpec

KERNEL_CHOICES = ("xla", "pallas", "auto", "pallas_tpu")
# decode's attention layers by pallas_kernels.attention.prep where the GPU attention kernels are
# selected (on the H200 the 40-layer 35B decode step at batch 1 runs 0.93x the time with it:
# benchmarks/README.md, model_step); read by select_kernels (benchmarks.model_step
# --no-attention-prep turns it off for a run)
ATTENTION_DECODE_KERNEL = True
# decode's GDN layers apply their gated RMSNorm inside the recurrent step kernel (a program per
# whole value head) instead of an XLA kernel after it: off, as on the H200 the step kernel's
# programs of a whole head cost more than the norm's kernel saves (40-layer 35B decode, GPU
# busy: the 30 step kernels 150 -> 254 us at batch 1, 769 -> 1196 us at 16, for 30 norm
# kernels of ~42 us at batch 1; benchmarks/README.md, model_step). Read by select_kernels
# (benchmarks.model_step --step-norm turns it on for a run)
DECODE_GATED_NORM = False


@dataclasses.dataclass(frozen=True)
class ArenaKernels:
    """Static choice of which arena steps run on the in-place kernels (:func:`select_kernels`).

    - ``gdn``: GDN tree verify and commit by :mod:`pallas_kernels.verify.arena` and
      :mod:`pallas_kernels.commit.arena` (the recurrent states read, and committed, in place
      through the table) instead of XLA state windows;
    - ``attention``: every attention layer by :mod:`pallas_kernels.attention.arena` (the KV
      pages read in place) instead of XLA's page gather: the tree verify's
      (``tree_attention``), decode's and prefill's (``paged_attention``, causal);
    - ``decode``: the decode step's GDN layers by :mod:`pallas_kernels.decode.arena` (the
      recurrent states read and written in place) instead of XLA state windows;
    - ``prefill``: prefill's GDN layers (``T > 1`` tokens per row) by
      :mod:`pallas_kernels.decode.arena`, or with ``tpu`` the chunked
      :func:`pallas_kernels.tpu.chunk_prefill_arena` (the initial states read, the final ones
      written, in place) instead of XLA state windows and the chunked rule;
    - ``tpu``: the Mosaic TPU versions of the GDN kernels (:mod:`pallas_kernels.tpu`:
      ``tree_verify_arena``, ``tree_commit_arena``, ``recurrent_step_arena`` and, with
      ``prefill``, the chunked ``chunk_prefill_arena``) instead of the GPU ones;
    - ``tpu_attention``: every attention layer by the TPU kernels (the KV pages read in
      place): decode's and prefill's by :func:`pallas_kernels.tpu.paged_attention_arena`, the
      tree verify's (committed pages, then the draft K/V along each node's path) by
      :func:`pallas_kernels.tpu.tree_attention_arena`, for trees of at most ``max_nodes``
      nodes within the VMEM cap (:func:`pallas_kernels.tpu.tree_attention_vmem`; a larger
      tree raises a ``ValueError``);
    - ``attention_decode``: with ``attention``, decode's attention layers from their fused
      projection output to their queries by :mod:`pallas_kernels.attention.prep` (head norms,
      rotary embedding, the token's K/V written into its page in place) instead of XLA's
      kernels and windowed K/V writes (:data:`ATTENTION_DECODE_KERNEL`);
    - ``decode_norm``: with ``decode``, the GDN layers' gated RMSNorm inside the decode step
      kernel (:data:`DECODE_GATED_NORM`);
    - ``interpret``: run them in Pallas interpret mode (the GPU kernels off a GPU, the TPU
      kernels in TPU interpret mode off a TPU);
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
    tpu: bool = False
    tpu_attention: bool = False
    attention_decode: bool = False
    decode_norm: bool = False

    @property
    def name(self) -> str:
        """``"pallas"`` when any step uses a kernel, else ``"xla"``."""
        used = self.gdn or self.attention or self.decode or self.prefill or self.tpu_attention
        return "pallas" if used else "xla"

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


def _tpu_attention_misfits(spec: ArenaSpec) -> list[str]:
    """Why the TPU attention kernels (paged and tree) cannot read this arena's KV pages
    (empty: they can): a head row must be one 128-word lane row and the K/V blocks start on a
    row (:mod:`pallas_kernels.tpu.attention`). The tree kernel's further limits depend on the
    tree: ``N <= max_nodes`` (:meth:`ArenaKernels.takes`) and its VMEM budget
    (:func:`pallas_kernels.tpu.tree_attention_vmem`, checked when it is traced)."""
    from pallas_kernels.tpu._common import LANES as TPU_LANES

    dt = jnp.dtype(spec.kv_dtype)
    if dt not in (jnp.float32, jnp.bfloat16):
        return [f"the KV cache is {dt}; the TPU attention kernel reads float32 or bfloat16"]
    out = []
    words = spec.head_dim * dt.itemsize // 4
    if words != TPU_LANES:
        out.append(f"head_dim {spec.head_dim} in {dt} is {words} words a head row, not {TPU_LANES}")
    if spec.kv_offset % TPU_LANES:
        out.append(f"the KV pages start {spec.kv_offset} words into a unit, not on a lane row")
    return out


def _tpu_gdn_misfits(spec: ArenaSpec, config, unit_align_words: int) -> list[str]:
    """Why the TPU arena GDN kernels cannot take this geometry (empty: they can): states of
    f32 ``[Hv, K, 128]`` on whole 128-word lane rows of an arena whose units are placed at
    multiples of 128 words (:mod:`pallas_kernels.tpu._arena`)."""
    from pallas_kernels.tpu._common import LANES as TPU_LANES

    out = []
    hv, dk, dv = spec.state_shape
    if jnp.dtype(spec.state_dtype) != jnp.float32:
        out.append(f"the recurrent state is {spec.state_dtype}; the TPU kernels read float32")
    if dv != TPU_LANES:
        out.append(f"linear_value_head_dim {dv} is not {TPU_LANES} (a state row per lane row)")
    if not (8 <= dk <= 256 and dk % 8 == 0):
        out.append(f"linear_key_head_dim {dk} is not a multiple of 8 in [8, 256]")
    if spec.state_offset % TPU_LANES:
        out.append(f"the recurrent state starts {spec.state_offset} words into its unit")
    if unit_align_words % TPU_LANES:
        out.append(
            f"the memory manager places units at multiples of {unit_align_words} words, not "
            f"{TPU_LANES} (MemoryManager(unit_align_words={TPU_LANES}))"
        )
    if jnp.dtype(spec.model_dtype) not in (jnp.float32, jnp.bfloat16):
        out.append(f"model dtype {spec.model_dtype} is not float32 or bfloat16")
    if config is not None and hv % config.linear_num_key_heads:
        out.append(f"linear_num_value_heads {hv} is not a multiple of the key heads")
    return out


def _attention_misfits(spec: ArenaSpec, config) -> list[str]:
    """Why the arena paged tree-attention kernel cannot take this geometry."""
    out = []
    if jnp.dtype(spec.kv_dtype) not in (jnp.float32, jnp.bfloat16):
        out.append(f"the KV cache is {spec.kv_dtype}; the attention kernel reads f32 or bf16")
    if spec.page_size < 16 or spec.page_size % 16:
        out.append(f"page_size {spec.page_size} is not a multiple of 16")
    if not _pow2(spec.head_dim):
        out.append(f"head_dim {spec.head_dim} is not a power of two >= 16")
    if config is not None and config.num_attention_heads % spec.kv_heads:
        out.append("num_attention_heads is not a multiple of num_key_value_heads")
    return out


def select_kernels(
    kernels: str,
    spec: ArenaSpec,
    config=None,
    backend: str | None = None,
    unit_align_words: int = 1,
) -> tuple[ArenaKernels, tuple[str, ...]]:
    """Resolves ``kernels`` (``"xla"`` | ``"pallas"`` | ``"auto"`` | ``"pallas_tpu"``) for the
    arena geometry ``spec`` (and the model ``config``, when given) on ``backend`` (default:
    JAX's), for an arena whose units sit at multiples of ``unit_align_words`` words.

    ``"auto"``: the kernels on a GPU backend where the geometry fits them (per part: GDN,
    attention), XLA elsewhere; ``"pallas"``: the kernels everywhere (interpret mode off GPU),
    a ``ValueError`` naming ``kernels`` when the geometry does not fit; ``"pallas_tpu"``: the
    TPU GDN kernels (verify, commit, decode step, prefill; TPU interpret mode off a TPU), a
    ``ValueError`` when the geometry does not fit them, and the TPU attention kernels (paged
    for decode and prefill, tree for the tree verify) where the head rows fit them (else XLA).
    Returns the choice and the reasons for every part left on XLA."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "xla":
        return XLA_KERNELS, ()
    backend = backend or jax.default_backend()
    if kernels == "pallas_tpu":
        from pallas_kernels.tpu import MAX_NODES as TPU_MAX_NODES

        if not spec.gdn_layers:
            raise ValueError("kernels='pallas_tpu': the model has no GDN layers")
        bad = _tpu_gdn_misfits(spec, config, unit_align_words)
        if bad:
            raise ValueError(f"kernels='pallas_tpu': {'; '.join(bad)}")
        attn_bad = _tpu_attention_misfits(spec) if spec.attn_layers else ["no attention layers"]
        choice = ArenaKernels(
            gdn=True,
            decode=True,
            prefill=True,
            interpret=backend != "tpu",
            max_nodes=TPU_MAX_NODES,
            strict=True,
            tpu=True,
            tpu_attention=not attn_bad,
        )
        if attn_bad and spec.attn_layers:
            return choice, (f"attention on XLA: {'; '.join(attn_bad)}",)
        return choice, ()
    if kernels == "auto" and backend != "gpu":
        note = (
            f"kernels='auto' on the {backend} backend: the arena Pallas kernels (Triton) are "
            "taken on GPU only"
        )
        return XLA_KERNELS, (note,)
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
        attention_decode=ATTENTION_DECODE_KERNEL and spec.attn_layers > 0 and not attn_bad,
        # The decode kernel under "auto" too: on the H200 a 30-layer Qwen3.5-35B decode step
        # takes 0.35-0.62x the time of XLA's state windows (benchmarks/arena_read.py, B 1-64).
        decode=spec.gdn_layers > 0 and not gdn_bad,
        decode_norm=DECODE_GATED_NORM and spec.gdn_layers > 0 and not gdn_bad,
        # The prefill kernel (a sequential scan over each chunk's tokens) only when asked for:
        # on the H200 it takes 1.38-1.97x the time of the state windows + the chunked Pallas
        # prefill at the default 64-token chunk, 0.82-0.87x at 16 (benchmarks/arena_read.py
        # --step prefill, B 1-64), so "auto" keeps the chunked rule.
        prefill=kernels == "pallas" and spec.gdn_layers > 0 and not gdn_bad,
        interpret=interpret,
        max_nodes=MAX_NODES if kernels == "pallas" else AUTO_MAX_NODES,
        strict=kernels == "pallas",
    )
    return choice, notes


def model_impl(kernels: str) -> str:
    """The ``impl`` of the model's own kernel-routed ops (``chunk_gated_delta_rule``,
    ``tree_verify``, ``tree_commit``, ``routed_experts``) under the engine's ``kernels``:
    ``"pallas_tpu"`` under ``"pallas_tpu"``, ``"xla"`` under ``"xla"`` and off a GPU (where
    ``"auto"`` is XLA anyway, so every engine on a CPU shares its compiled programs), ``"auto"``
    otherwise."""
    if kernels == "pallas_tpu":
        return "pallas_tpu"
    return "auto" if kernels != "xla" and jax.default_backend() == "gpu" else "xla"
