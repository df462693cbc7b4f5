"""The user API: ``LLM(model, ...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
import re
import time
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models import HybridLM, ModelConfig, from_pretrained, init_random
from gdn_jax.models import fused as fused_proj
from gdn_jax.models.loading import load_config
from gdn_jax.models.model import set_kernel_impl
from serving.engine import Engine, buckets_for, make_drafter
from serving.kernels import KERNEL_CHOICES, model_impl
from serving.launch import DEFAULT_GRAPH_TOKENS
from serving.memory import MemoryManager, OutOfMemoryError, layout_for
from serving.parallel import ParallelConfig, ReplicaEngine, ReplicaScheduler
from serving.params import SamplingParams, SpecConfig
from serving.runner import ArenaRunner, ModelRunner, MTPRunner
from serving.scheduler import ADMISSIONS, Request, Scheduler
from serving.tokenizer import load_tokenizer

_ids = itertools.count()


LOAD_FORMATS = ("auto", "dummy")


class RequestTooLargeError(OutOfMemoryError, ValueError):
    """A request that can never fit in the memory arena, even alone: an ``OutOfMemoryError``
    that is also a ``ValueError`` (a bad request, refused before it runs)."""


@dataclasses.dataclass
class RequestOutput:
    """One request's generated ``token_ids`` (its prompt excluded), ``text`` when the model
    has a tokenizer, ``finish_reason`` (``"length"``: ``max_tokens`` reached, ``"stop"``: a
    stop token or stop string) and ``metrics``: ``ttft_s``, ``tpot_s``, ``latency_s``,
    ``num_tokens``, ``acceptance_lengths`` (tokens emitted per verify step),
    ``mean_acceptance_length``, ``preemptions``, ``spec_bytes``."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    metrics: dict[str, Any]
    text: str | None = None
    finish_reason: str | None = None


@dataclasses.dataclass
class StreamOutput:
    """What one request produced in one engine step: its new ``token_ids`` and their ``text``
    (``None`` without a tokenizer; a character split across tokens or a possible start of a
    stop string is held back until it is complete). The last one of a request has
    ``finished`` and ``finish_reason`` set and the whole :class:`RequestOutput` as ``output``;
    a request the scheduler rejected (it can never fit in memory) ends with ``error`` set,
    ``finish_reason == "error"`` and no ``output``."""

    request_id: Hashable
    index: int
    token_ids: list[int]
    text: str | None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    output: RequestOutput | None = None


@dataclasses.dataclass(eq=False)
class _Live:
    """A request in flight: what of it has been handed out so far."""

    req: Request
    text: bool  # decode text at every step (streams and stop strings)
    buffered: bool  # outputs go to the LLM's outbox (generate / stream) instead of step()'s caller
    sent: int = 0
    text_sent: str = ""


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _with_kernel_impl(model: HybridLM, kernels: str, fuse: bool = False) -> HybridLM:
    """A view of ``model`` (the same weight arrays; the caller's model is untouched) whose own
    kernel-routed ops follow ``kernels`` (:func:`serving.kernels.model_impl`); with ``fuse``
    its input projections fused (:func:`gdn_jax.models.fuse_projections`: new arrays for
    those weights, the caller's stay as they are)."""
    view = nnx.merge(*nnx.split(model))
    set_kernel_impl(view, model_impl(kernels))
    if fuse:
        fused_proj.fuse_projections(view)
    return view


def _loaders(sharding):
    """``(init_random, from_pretrained)``, placing each parameter at ``sharding(path, shape)``
    when given."""
    if sharding is None:
        return init_random, from_pretrained
    from gdn_jax.sharding import state_shardings

    return (
        functools.partial(init_random, sharding=lambda st: state_shardings(st, sharding)),
        functools.partial(from_pretrained, sharding=lambda p, x: sharding(p, tuple(x.shape))),
    )


def load_model(
    model: Any,
    dtype=jnp.bfloat16,
    seed: int = 0,
    *,
    load_format: str = "auto",
    name: str = "model",
    sharding=None,
) -> HybridLM:
    """An :class:`HybridLM` from itself, a :class:`ModelConfig` or an HF config dict (random
    weights), or a local path: an HF directory loads its weights; with
    ``load_format="dummy"`` a directory or a ``config.json`` gives random weights instead.
    Errors are ``ValueError`` naming the argument (``name``) and the file. ``sharding(path,
    shape)`` (a dotted parameter path) places each created or loaded parameter
    (:meth:`serving.parallel.Placement.load_sharding`)."""
    init_random, from_pretrained = _loaders(sharding)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if isinstance(model, HybridLM):
        return model
    if isinstance(model, ModelConfig):
        return init_random(model, dtype, seed=seed)
    if isinstance(model, dict):
        try:
            config = ModelConfig.from_hf_dict(model)
        except KeyError as e:
            raise ValueError(f"{name}: the config dict has no key {e}") from None
        return init_random(config, dtype, seed=seed)
    if not isinstance(model, str | Path):
        raise ValueError(
            f"{name} must be a HybridLM, ModelConfig, HF config dict or local path, got "
            f"{type(model).__name__}"
        )
    path = Path(model).expanduser()
    if not path.exists():
        if isinstance(model, str) and _HUB_ID.fullmatch(model):
            raise ValueError(
                f"{name}: {model!r} is not a local directory. Only local directories load: "
                "download the checkpoint first (e.g. `huggingface-cli download "
                f"{model} --local-dir DIR`) and pass DIR"
            )
        raise ValueError(f"{name}: {path} does not exist")
    try:
        if load_format == "dummy":
            return init_random(load_config(path), dtype, seed=seed)
        if path.is_file():
            raise ValueError(
                f"{name}: {path} is a config file without weights; give the model's directory, "
                "or load_format='dummy' for random weights"
            )
        if not (path / "config.json").is_file():
            raise ValueError(f"{name}: {path} has no config.json")
        if not (
            any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
        ):
            raise ValueError(
                f"{name}: no *.safetensors weights in {path}; pass load_format='dummy' for "
                "random weights"
            )
        return from_pretrained(path, dtype)
    except (ValueError, FileNotFoundError) as e:
        msg = str(e) if str(e).startswith(f"{name}:") else f"{name}: {e}"
        raise (type(e) if isinstance(e, ValueError) else ValueError)(msg) from None


class LLM:
    """A serving engine over one hybrid model.

    Args:
      model: a local HF directory (``config.json`` + safetensors weights), a
        :class:`ModelConfig` or an HF config dict (random weights), or a :class:`HybridLM`. A
        directory without weights or a ``config.json`` path needs ``load_format="dummy"``.
      memory_budget: bytes of the memory manager's arena (KV pages, state slots, speculative
        scratch; with a ``draft_model`` drafter and ``cache="arena"`` the draft's cache too, in
        the same pages and slots). Default: room for ``max_num_seqs`` requests of
        ``max_model_len`` tokens.
      memory_policy: ``"avmp"`` | ``"unified_padded"`` | ``"static_dual"`` | ``"multi_ended"``.
      speculative: a :class:`SpecConfig`, or ``None`` for plain decoding.
      max_num_seqs: most requests decoding at once (the largest batch bucket).
      max_model_len: most tokens (prompt + output + draft depth) of one request.
      page_size: tokens per KV page. prefill_chunk: tokens per request per prefill step
        (the H200 figures of ``benchmarks/model_step.py`` take 2048 for a 35B-class model).
      prefill_buckets: smaller prefill widths (tokens per row, each at most
        ``prefill_chunk``): a prefill step pads its rows to the smallest bucket (or
        ``prefill_chunk``) that holds its longest chunk, so a large chunk costs short prompts
        little; each width compiles its own program when first used. Default: none (every
        step ``prefill_chunk`` wide).
      max_prefill_tokens: most prompt tokens one prefill step computes: the step takes a
        chunk from each of the ``max(1, max_prefill_tokens // prefill_chunk)`` oldest
        prefilling requests (the others wait a step), which bounds the prefill program's
        activations. Default: ``max(8192, prefill_chunk)``.
      batch_buckets: the padded batch sizes the steps compile for (default: powers of two
        below ``max_num_seqs``, and ``max_num_seqs``); the largest must be ``max_num_seqs``.
      cuda_graph_max_tokens: on a GPU every step runs as one CUDA graph (``None``, the
        default); a bound runs only steps of at most this many tokens (rows x tokens per row)
        as graphs and launches larger ones kernel by kernel (:mod:`serving.launch`). ``0``: no
        graphs.
      num_scheduler_steps: up to this many steps per engine step back to back, each fed the
        previous one's tokens on the device, so the host's work for a step overlaps the
        device's for the one before (vLLM's name): plain decode steps (the argmax, or a
        draw keyed by the row's output position, fed back), or speculative steps drafted on
        the device (draft model, MTP, n-gram trees; each row's root, length and
        random-stream position advanced by its emitted tokens); greedy or sampled, the same
        tokens as one step at a time. The tokens reach the host, and the scheduler admits
        requests, once per engine step. Steps with a prefilling request take one step.
        Default 1.
      async_scheduling: steps overlapped with the host (vLLM's async scheduling): the engine
        admits, reserves and dispatches step t+1 while step t runs, t's outputs fed to t+1 on
        the device, then fetches t's tokens: plain decode steps, and speculative steps drafted
        on the device (draft model, MTP, n-gram trees; each row's root, length, random
        stream and MTP hidden state or n-gram tokens advanced by its request's tokens of t).
        Requests join and leave between any two steps, and the tokens are those of one step
        at a time. A step with a prefilling request, and trees built on the host, run in
        order. Not with ``num_scheduler_steps > 1``. Default False.
      admission: what admitting a request reserves in the arena: ``"chunk"`` (default) the
        pages of its first prefill chunk, the rest growing step by step (vLLM's way; a
        request preempted part way through its prefill recomputes its chunks); ``"prompt"``
        the pages of its whole prompt, so a request once admitted never waits on memory for
        its own prefill (fewer preemptions when long prompts crowd a small arena, at the
        cost of holding pages before their chunks run).
      dtype: weights and KV dtype (``"bfloat16"`` or ``"float32"``); the conv state is
        stored in it too, the recurrent state in f32.
      cache: where the target's cache lives. ``"arena"`` (default): only in the memory
        manager's arena, read and written through the requests' handles (KV pages and state
        slots exist once), and so does a draft model's (``draft_*`` fields of the same units,
        :class:`serving.memory.HybridLayout`; a draft without both GDN and attention layers
        keeps its own pools). ``"pools"``: the engines' own per-layer pools,
        the manager only accounting (the cache is then held twice; kept as a reference for
        tests).
      kernels: how the arena cache's steps run (``cache="arena"`` only): ``"auto"``
        (default: on GPU the Pallas kernels that read the arena in place: tree verify,
        commit, the GDN decode step and paged attention; XLA on other backends),
        ``"pallas"`` (the same kernels everywhere, plus prefill's GDN states in place;
        interpret mode off GPU), ``"pallas_tpu"`` (the Mosaic TPU GDN kernels for tree
        verify, commit, the decode step and prefill, TPU interpret mode off a TPU; the arena's
        units placed on 128-word lane rows; needs ``linear_value_head_dim`` 128 and one device;
        the attention layers on the TPU paged and tree attention kernels where a KV head row
        is 128 words, else XLA) or ``"xla"``;
        see :class:`serving.runner.ArenaRunner`. The model's own kernel-routed ops (the chunked
        prefill, tree verify and commit, the MoE's routed experts) run with ``impl="xla"``
        under ``"xla"``, ``impl="pallas_tpu"`` under ``"pallas_tpu"`` and ``impl="auto"``
        otherwise
        (:func:`gdn_jax.models.model.set_kernel_impl`).
      load_format: ``"auto"`` (default: a path must hold weights) or ``"dummy"`` (random
        weights from the path's config, vLLM's name); also used for a ``draft_model`` path.
      tokenizer: for text prompts: ``"bytes"``, a directory, or an object with ``encode`` and
        ``decode``. Default: the model directory's (:func:`serving.tokenizer.load_tokenizer`),
        none for a config or a model object.
      tensor_parallel_size: devices one engine splits the model's heads (and, with
        ``enable_expert_parallel``, its experts) over (:mod:`serving.parallel`): each holds
        its share of the weights and its own arena of ``memory_budget`` bytes for its heads of
        every request's cache (``cache="arena"`` only).
      data_parallel_size: independent engine replicas, each over ``tensor_parallel_size``
        devices with its own weights, scheduler and arena; requests go to the least loaded.
      enable_expert_parallel: split the routed experts over the tensor-parallel devices
        (whole experts per device) instead of splitting every expert's intermediate dimension.
      devices: the ``data_parallel_size * tensor_parallel_size`` devices to use, replica by
        replica (default: the first of ``jax.devices()``, every host's after
        ``jax.distributed.initialize``).
      fuse_projections: run each block's input projections that read one input (a GDN
        layer's four, attention's q/k/v, an MLP's gate and up, an MoE block's router and
        shared expert) as one matmul over their concatenated weights
        (:func:`gdn_jax.models.fuse_projections`; fewer kernels and weight arrays a step).
        The engine fuses its own view of the model: a model object passed in keeps its
        arrays, so those weights are then held twice. Default on; off on several devices.
    """

    def __init__(
        self,
        model: Any,
        memory_budget: int | None = None,
        memory_policy: str = "avmp",
        speculative: SpecConfig | None = None,
        *,
        max_num_seqs: int = 8,
        max_model_len: int = 1024,
        page_size: int = 16,
        prefill_chunk: int = 64,
        max_prefill_tokens: int | None = None,
        prefill_buckets: Sequence[int] = (),
        batch_buckets: Sequence[int] | None = None,
        cuda_graph_max_tokens: int | None = DEFAULT_GRAPH_TOKENS,
        num_scheduler_steps: int = 1,
        async_scheduling: bool = False,
        admission: str = "chunk",
        segment_bytes: int | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        cache: str = "arena",
        kernels: str = "auto",
        load_format: str = "auto",
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        devices: Sequence | None = None,
        fuse_projections: bool = True,
    ):
        args = {k: v for k, v in locals().items() if k != "self"}
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("page_size", page_size),
            ("prefill_chunk", prefill_chunk),
            ("max_prefill_tokens", 1 if max_prefill_tokens is None else max_prefill_tokens),
            ("num_scheduler_steps", num_scheduler_steps),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {async_scheduling!r}")
        if async_scheduling and num_scheduler_steps > 1:
            raise ValueError(
                "async_scheduling: not with num_scheduler_steps > 1 "
                f"(got {num_scheduler_steps}); pick one way to overlap the host"
            )
        if not all(
            isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= prefill_chunk
            for w in prefill_buckets
        ):
            raise ValueError(
                f"prefill_buckets must be ints in [1, prefill_chunk={prefill_chunk}], "
                f"got {tuple(prefill_buckets)!r}"
            )
        if cuda_graph_max_tokens is not None and (
            not isinstance(cuda_graph_max_tokens, int) or cuda_graph_max_tokens < 0
        ):
            raise ValueError(
                "cuda_graph_max_tokens must be None or a non-negative int, got "
                f"{cuda_graph_max_tokens!r}"
            )
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        if cache not in ("arena", "pools"):
            raise ValueError(f"cache must be 'arena' or 'pools', got {cache!r}")
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        if kernels in ("pallas", "pallas_tpu") and cache != "arena":
            raise ValueError(
                f"kernels={kernels!r} needs cache='arena' (the kernels read the arena)"
            )
        if speculative is not None and not isinstance(speculative, SpecConfig):
            raise ValueError(f"speculative must be a SpecConfig or None, got {speculative!r}")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        if speculative is not None and speculative.max_depth + 2 > max_model_len:
            raise ValueError(
                f"speculative: a draft depth of {speculative.max_depth} leaves no room for a "
                f"prompt and a token within max_model_len={max_model_len}"
            )
        if batch_buckets is None:
            batch_buckets = buckets_for(max_num_seqs)
        batch_buckets = tuple(sorted(int(b) for b in batch_buckets))
        if not batch_buckets or batch_buckets[0] < 1 or batch_buckets[-1] != max_num_seqs:
            raise ValueError(
                f"batch_buckets must be positive sizes ending at max_num_seqs={max_num_seqs}, "
                f"got {batch_buckets}"
            )
        self.parallel = ParallelConfig(
            tensor_parallel_size, data_parallel_size, enable_expert_parallel, devices
        )
        if tensor_parallel_size > 1 and cache != "arena":
            raise ValueError("cache: tensor_parallel_size > 1 needs cache='arena'")
        if data_parallel_size > 1:  # independent replicas, one per row of the device mesh
            replicas = [
                LLM(**{**args, "data_parallel_size": 1, "devices": row})
                for row in self.parallel.replica_devices()
            ]
            parallel = self.parallel
            vars(self).update(vars(replicas[0]))
            self.parallel, self.replicas = parallel, replicas
            self.scheduler = ReplicaScheduler([r.scheduler for r in replicas])
            self.engine = ReplicaEngine([r.engine for r in replicas])
            self._live, self._outbox = {}, {}
            return
        self.replicas = []
        placement = None
        if self.parallel.enabled:
            if kernels == "pallas_tpu":
                raise ValueError(
                    "kernels='pallas_tpu' runs on one device: the multi-device arenas are not "
                    "laid out for the TPU kernels"
                )
            self.parallel.check_source(model)  # before loading anything
            placement = self.parallel.placement(model_impl(kernels))
        jdtype = jnp.dtype(dtype)
        base = load_model(
            model,
            jdtype,
            seed,
            load_format=load_format,
            sharding=placement.load_sharding if placement else None,
        )
        if placement is not None:
            self.parallel.check_model(base.config)
            base = placement.place(base)
        fuse = fuse_projections and placement is None
        self.model = _with_kernel_impl(base, kernels, fuse)
        del base  # a model loaded here: its unfused projections go
        self.config = self.model.config
        self.speculative = speculative
        if tokenizer is None and isinstance(model, str | Path):
            tokenizer = model
        try:
            self.tokenizer = load_tokenizer(tokenizer)
        except ValueError as e:
            raise ValueError(f"tokenizer: {e}") from None
        pages_per_seq = -(-max_model_len // page_size)
        n = speculative.num_nodes if speculative else 1
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = _with_kernel_impl(
                load_model(
                    speculative.draft_model,
                    jdtype,
                    seed + 1,
                    load_format=load_format,
                    name="draft_model",
                ),
                kernels,
                fuse,
            )
            if draft.config.vocab_size != self.config.vocab_size:
                raise ValueError(
                    f"draft_model: vocab_size {draft.config.vocab_size} != target's "
                    f"{self.config.vocab_size}"
                )
        draft_placement = None
        if placement is not None and draft is not None:  # split by heads, or replicated
            draft_placement = placement.for_draft(draft.config)
            draft = draft_placement.place(draft)
        # on several devices: one device's share of the cache (serving.parallel)
        cfg = placement.local_config(self.config) if placement else self.config
        layout = layout_for(cfg.to_hf_dict(), page_size, spec_nodes=n, kv_dtype=dtype)
        layout = dataclasses.replace(layout, conv_dtype=dtype)  # the model's conv state dtype
        # the draft's cache shares the target's units: draft_* fields in each kv page and state
        # slot (the same tokens), so it lives in the arena and under the budget too. (A draft
        # without both layer kinds has no such layout and keeps its own pools.)
        draft_in_arena = (
            draft is not None
            and cache == "arena"
            and bool(draft.config.gdn_layers)
            and bool(draft.config.attn_layers)
        )
        if draft_in_arena:
            dcfg = draft_placement.local_config(draft.config) if placement else draft.config
            layout = dataclasses.replace(
                layout, draft=layout_for(dcfg.to_hf_dict(), page_size, spec_nodes=1)
            )
        spec_kind = None
        if speculative is not None:
            spec_kind = "snapshot" if speculative.verify == "snapshot" else "stash"
        spec_units = n if spec_kind == "snapshot" else 1
        per_req = (
            pages_per_seq * layout.unit_bytes("kv")
            + layout.unit_bytes("state")
            + (spec_units * layout.unit_bytes(spec_kind) if spec_kind else 0)
        )
        if memory_budget is None:
            memory_budget = 2 * max_num_seqs * per_req + (8 << 20)
        try:
            if placement:
                self.manager = placement.memory_manager(
                    layout, int(memory_budget), memory_policy, segment_bytes=segment_bytes
                )
            else:  # the TPU kernels move states as whole 128-word lane rows
                align = 1
                if kernels == "pallas_tpu":
                    from pallas_kernels.tpu._common import LANES as align
                self.manager = MemoryManager(
                    layout,
                    int(memory_budget),
                    memory_policy,
                    segment_bytes=segment_bytes,
                    unit_align_words=align,
                )
        except ValueError as e:
            raise ValueError(f"memory_budget / memory_policy / segment_bytes: {e}") from None
        self.layout = layout
        self.spec_bytes_per_request = spec_units * layout.unit_bytes(spec_kind) if spec_kind else 0
        # a kv handle holds tokens_per_page tokens (more than page_size under unified_padded)
        page_size = self.manager.tokens_per_page
        pages_per_seq = -(-max_model_len // page_size)
        num_pages = max_num_seqs * pages_per_seq
        if cache == "arena":
            self.runner = ArenaRunner(
                self.model,
                self.manager,
                kernels=kernels,
                placement=placement,
                graph_tokens=cuda_graph_max_tokens,
            )
        else:
            self.runner = ModelRunner(
                self.model,
                num_slots=max_num_seqs,
                num_pages=num_pages,
                page_size=page_size,
                pages_per_seq=pages_per_seq,
            )
        draft_runner = mtp_runner = None
        if draft_in_arena:
            # (the draft's geometry may not suit the kernels the target was forced onto)
            draft_kernels = "auto" if kernels in ("pallas", "pallas_tpu") else kernels
            draft_runner = ArenaRunner(
                draft,
                self.manager,
                kernels=draft_kernels,
                draft=True,
                placement=draft_placement,
                graph_tokens=cuda_graph_max_tokens,
            )
        elif draft is not None:
            draft_runner = ModelRunner(
                draft,
                num_slots=max_num_seqs,
                num_pages=num_pages,
                page_size=page_size,
                pages_per_seq=pages_per_seq,
            )
        if speculative is not None and speculative.method == "mtp":
            mtp_runner = MTPRunner(self.model)
        drafter = (
            make_drafter(speculative, self.config.vocab_size, draft_runner, mtp_runner)
            if speculative
            else None
        )
        self._scheduler_args = dict(
            admission=admission,
            num_slots=max_num_seqs,
            num_pages=num_pages,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
            spec_kind=spec_kind,
            spec_units=spec_units,
        )
        self.scheduler = Scheduler(self.manager, **self._scheduler_args)
        self.engine = Engine(
            self.runner,
            self.scheduler,
            max_num_seqs=max_num_seqs,
            batch_buckets=batch_buckets,
            prefill_chunk=prefill_chunk,
            prefill_buckets=tuple(prefill_buckets),
            max_prefill_rows=max(
                1, (max_prefill_tokens or max(8192, prefill_chunk)) // prefill_chunk
            ),
            spec=speculative,
            drafter=drafter,
            draft_runner=draft_runner,
            num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling,
        )
        self.max_model_len = pages_per_seq * page_size
        self._depth = speculative.max_depth if speculative else 0
        self._max_request_tokens = self._tokens_alone(spec_kind, spec_units, pages_per_seq)
        self._live: dict[Hashable, _Live] = {}
        self._outbox: dict[Hashable, list[StreamOutput]] = {}

    def _tokens_alone(self, spec_kind: str | None, spec_units: int, pages_per_seq: int) -> int:
        """Most tokens one request can hold with nothing else in the arena (a dry run on the
        empty manager); ``ValueError`` when not even one page fits."""
        base = [("state", 1)] + ([(spec_kind, spec_units)] if spec_kind else [])

        def fits(pages: int) -> bool:
            return self.manager.fits_all([*base, ("kv", pages)])

        if not fits(1):
            stats = self.manager.stats()
            raise ValueError(
                f"memory_budget: the arena ({stats['arena_bytes']} bytes under policy "
                f"{stats['policy']!r}) cannot hold one request: a state slot, "
                f"{self.spec_bytes_per_request} bytes of speculative scratch and one KV page"
            )
        lo, hi = 1, pages_per_seq
        while lo < hi:  # the largest page count that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo * self.manager.tokens_per_page

    def compiled_programs(self) -> int:
        """Jitted programs compiled so far (constant in a steady state)."""
        return self.engine.compiled()

    # ------------------------------------------------------------------------- requests

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress=None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one :class:`RequestOutput` per prompt, in order.

        ``prompts``: one prompt or a list of them; a prompt is a string (through the model's
        tokenizer), a list of token ids, or a dict with ``"prompt"`` (text) or
        ``"prompt_token_ids"``; a flat list of ints is one prompt. ``sampling_params``: one
        :class:`SamplingParams` for every prompt, or a list with one per prompt (default
        ``SamplingParams()``). Every prompt is checked before any runs (``ValueError`` naming
        ``prompts[i]``), so a refused call leaves the engine as it was. ``progress(n)`` is
        called with the number of tokens emitted at each step. A request that can never fit in
        the arena raises :class:`RequestTooLargeError` (an ``OutOfMemoryError`` and a
        ``ValueError``): before anything runs, or, when the scheduler finds it at run time,
        once the other requests have finished.
        """
        rids = self._submit(prompts, sampling_params, text=False)
        done: dict[Hashable, StreamOutput] = {}
        try:
            while len(done) < len(rids):
                self._advance()
                emitted = 0
                for rid in rids:
                    for out in self._outbox.pop(rid, ()):
                        emitted += len(out.token_ids)
                        if out.finished:
                            done[rid] = out
                if progress is not None and emitted:
                    progress(emitted)
        finally:
            self._drop(rids)
        for out in done.values():
            if out.error is not None:
                raise RequestTooLargeError(f"prompts[{out.index}]: {out.error}")
        return [done[rid].output for rid in rids]

    def stream(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamOutput]:
        """Like :meth:`generate`, but yields a :class:`StreamOutput` for each request at every
        step where it emitted tokens or finished (``index`` is the prompt's position). Closing
        the generator early aborts its unfinished requests."""
        rids = self._submit(prompts, sampling_params, text=True)
        left = set(rids)
        try:
            while left:
                self._advance()
                for rid in rids:
                    for out in self._outbox.pop(rid, ()):
                        if out.finished:
                            left.discard(rid)
                        yield out
        finally:
            self._drop(rids)

    def add_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        *,
        index: int = 0,
    ) -> Hashable:
        """Queues one request and returns its id; :meth:`step` advances it. ``index`` keys its
        random draws with ``SamplingParams.seed`` (as a prompt's position does in
        :meth:`generate`). Raises ``ValueError`` (nothing queued) for a bad prompt or one that
        can never fit."""
        ids = self.prompt_ids(prompt, "prompt")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {params!r}")
        self.check_request(ids, params, "prompt")
        return self._add(ids, params, index, text=True, buffered=False)

    def step(self) -> list[StreamOutput]:
        """Runs one engine iteration (admission, a prefill chunk, a decode or speculative step)
        and returns a :class:`StreamOutput` for each request of :meth:`add_request` that
        emitted tokens or finished."""
        return self._advance()

    def abort_request(self, request_id: Hashable) -> None:
        """Drops a request (waiting or running) and frees its memory; unknown ids are ignored."""
        live = self._live.pop(request_id, None)
        self._outbox.pop(request_id, None)
        if live is not None and not live.req.finished:
            self.scheduler.abort(live.req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def prompt_ids(self, prompt: Any, name: str = "prompt") -> list[int]:
        """Token ids of one prompt (text, token ids, or a dict with ``"prompt"`` or
        ``"prompt_token_ids"``), checked against the vocabulary; ``ValueError`` naming ``name``."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"{name}: a dict prompt needs 'prompt' (text) or 'prompt_token_ids'"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name}: text prompts need a model tokenizer (this model has none; give "
                    "token ids or LLM(tokenizer=...))"
                )
            prompt = self.tokenizer.encode(prompt)
        elif isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(f"{name}: token ids must be a 1-d integer array")
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            pass  # the common case, checked without the abstract-class test per id
        elif not isinstance(prompt, Sequence) or not all(_is_int(t) for t in prompt):
            raise ValueError(
                f"{name}: expected a string, a list of token ids or a dict, got "
                f"{type(prompt).__name__}"
                + (f" {prompt!r}" if not isinstance(prompt, Sequence) else " with non-int items")
            )
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"{name} is empty")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{name} has ids outside [0, {vocab})")
        return ids

    def check_request(self, ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        """``ValueError`` naming ``name`` when the request can never run: its prompt, its
        ``max_tokens`` and the draft depth exceed ``max_model_len`` or what the arena holds for
        one request, or it asks for stop strings without a tokenizer."""
        need = len(ids) + params.max_tokens + self._depth
        parts = f"{len(ids)} prompt tokens + max_tokens {params.max_tokens}"
        if self._depth:
            parts += f" + draft depth {self._depth}"
        if need > self.max_model_len:
            raise ValueError(
                f"{name}: {parts} = {need} tokens, more than max_model_len={self.max_model_len}"
            )
        if need > self._max_request_tokens:
            raise RequestTooLargeError(
                f"{name}: {parts} = {need} tokens, but memory_budget holds at most "
                f"{self._max_request_tokens} tokens for one request"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a model tokenizer")

    def _submit(self, prompts: Any, sampling_params: Any, *, text: bool) -> list[Hashable]:
        """Checks every prompt and its parameters, then queues them all (nothing is queued
        when one is refused)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, Sequence) and prompts and all(_is_int(t) for t in prompts)
        ):
            prompts = [prompts]
        elif isinstance(prompts, np.ndarray):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        if not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a string, token ids, a dict or a list of them, got "
                f"{type(prompts).__name__}"
            )
        if not prompts:
            raise ValueError("prompts: no prompts")
        ids = [self.prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(
                    f"sampling_params: {len(params)} given for {len(ids)} prompts (give one, "
                    "or one per prompt)"
                )
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be SamplingParams, got {p!r}")
        else:
            raise ValueError(
                f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r}"
            )
        for i, (p, sp) in enumerate(zip(ids, params, strict=True)):
            self.check_request(p, sp, f"prompts[{i}]")
        return [
            self._add(p, sp, i, text=text, buffered=True)
            for i, (p, sp) in enumerate(zip(ids, params, strict=True))
        ]

    def _add(
        self, ids: list[int], params: SamplingParams, index: int, *, text: bool, buffered: bool
    ) -> Hashable:
        req = Request(
            index=index,
            rid=("req", next(_ids)),
            prompt=ids,
            params=params,
            arrival=time.perf_counter(),
        )
        self.scheduler.add(req)
        wants_text = self.tokenizer is not None and (text or bool(params.stop))
        self._live[req.rid] = _Live(req, text=wants_text, buffered=buffered)
        return req.rid

    def _drop(self, rids: list[Hashable]) -> None:
        for rid in rids:
            self.abort_request(rid)

    def _advance(self) -> list[StreamOutput]:
        """One engine iteration; each live request's news goes to the outbox (requests of
        :meth:`generate` / :meth:`stream`) or is returned (requests of :meth:`add_request`)."""
        if self.scheduler.waiting or self.scheduler.running:
            self.engine.step()
        direct = []
        for rid, live in list(self._live.items()):
            out = self._news(live)
            if out is None:
                continue
            if out.finished:
                del self._live[rid]
            if live.buffered:
                self._outbox.setdefault(rid, []).append(out)
            else:
                direct.append(out)
        return direct

    def _news(self, live: _Live) -> StreamOutput | None:
        """What ``live`` produced since it was last asked: new tokens, their text (stop strings
        found and cut), and, when it finished, its :class:`RequestOutput`."""
        r = live.req
        if r.error is not None:
            return StreamOutput(
                r.rid, r.index, [], None, True, finish_reason="error", error=r.error
            )
        n, finished = len(r.output), r.finished
        if n == live.sent and not finished:
            return None
        new = r.output[live.sent : n]
        live.sent = n
        reason = None
        delta = full = None
        if live.text:
            full = self.tokenizer.decode(r.output)
            stop = r.params.stop
            longest = max((len(x) for x in stop), default=0)
            if stop:
                start = max(0, len(live.text_sent) - longest + 1)
                hits = [i for i in (full.find(x, start) for x in stop) if i >= 0]
                if hits:
                    full = full[: min(hits)]
                    if not finished:
                        self.scheduler.abort(r)
                    finished, reason = True, "stop"
            end = len(full)
            if not finished:  # hold back a partial character and a possible stop-string start
                end -= max(longest - 1, 0)
                while end > 0 and full[end - 1] == "\ufffd":
                    end -= 1
            delta = ""
            if full.startswith(live.text_sent) and end > len(live.text_sent):
                delta = full[len(live.text_sent) : end]
                live.text_sent += delta
        if not finished:
            return StreamOutput(r.rid, r.index, new, delta)
        if reason is None:
            stop_ids = r.params.stop_token_ids
            reason = "stop" if r.output and r.output[-1] in stop_ids else "length"
        output = self._output(r, reason, full)
        return StreamOutput(r.rid, r.index, new, delta, True, reason, output=output)

    def _output(self, r: Request, finish_reason: str, text: str | None = None) -> RequestOutput:
        n = len(r.output)
        tpot = (r.last_token_time - r.first_token_time) / (n - 1) if n > 1 else 0.0
        acc = r.accept_lengths
        metrics = dict(
            ttft_s=r.first_token_time - r.arrival,
            tpot_s=tpot,
            latency_s=r.last_token_time - r.arrival,
            num_tokens=n,
            acceptance_lengths=list(acc),
            mean_acceptance_length=float(np.mean(acc)) if acc else 1.0,
            preemptions=r.preemptions,
            spec_bytes=self.spec_bytes_per_request,
        )
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output)
        return RequestOutput(r.index, list(r.prompt), list(r.output), metrics, text, finish_reason)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
