"""The user API: ``LLM(model, ...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models import HybridLM, ModelConfig, from_pretrained, init_random
from gdn_jax.models.model import set_kernel_impl
from serving.engine import Engine, buckets_for, make_drafter
from serving.kernels import KERNEL_CHOICES, model_impl
from serving.memory import MemoryManager, layout_for
from serving.params import SamplingParams, SpecConfig
from serving.runner import ArenaRunner, ModelRunner, MTPRunner
from serving.scheduler import Request, Scheduler

_ids = itertools.count()


@dataclasses.dataclass
class RequestOutput:
    """One request's generated ``token_ids`` (its prompt excluded), ``text`` when the model
    has a tokenizer, and ``metrics``: ``ttft_s``, ``tpot_s``, ``acceptance_lengths`` (tokens
    emitted per verify step), ``mean_acceptance_length``, ``preemptions``."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    metrics: dict[str, Any]
    text: str | None = None


def _with_kernel_impl(model: HybridLM, kernels: str) -> HybridLM:
    """A view of ``model`` (the same weight arrays; the caller's model is untouched) whose own
    kernel-routed ops follow ``kernels`` (:func:`serving.kernels.model_impl`)."""
    view = nnx.merge(*nnx.split(model))
    set_kernel_impl(view, model_impl(kernels))
    return view


def load_model(model: Any, dtype=jnp.bfloat16, seed: int = 0) -> HybridLM:
    """An :class:`HybridLM` from itself, an HF directory (weights), a ``config.json`` path,
    a :class:`ModelConfig` or an HF config dict (random weights)."""
    if isinstance(model, HybridLM):
        return model
    if isinstance(model, ModelConfig):
        return init_random(model, dtype, seed=seed)
    if isinstance(model, dict):
        return init_random(ModelConfig.from_hf_dict(model), dtype, seed=seed)
    if isinstance(model, str | Path):
        path = Path(model)
        if path.is_dir() and any(path.glob("*.safetensors")):
            return from_pretrained(path, dtype)
        if path.is_file() or (path / "config.json").is_file():
            return init_random(ModelConfig.from_json(path), dtype, seed=seed)
        raise ValueError(f"model: {path} is neither an HF directory nor a config.json")
    raise ValueError(
        f"model must be a HybridLM, ModelConfig, HF config dict or path, got {type(model)}"
    )


class LLM:
    """A serving engine over one hybrid model.

    Args:
      model: HF directory, ``config.json``, :class:`ModelConfig`, HF config dict or model.
      memory_budget: bytes of the memory manager's arena (KV pages, state slots, speculative
        scratch; with a ``draft_model`` drafter and ``cache="arena"`` the draft's cache too, in
        the same pages and slots). Default: room for ``max_num_seqs`` requests of
        ``max_model_len`` tokens.
      memory_policy: ``"avmp"`` | ``"unified_padded"`` | ``"static_dual"`` | ``"multi_ended"``.
      speculative: a :class:`SpecConfig`, or ``None`` for plain decoding.
      max_num_seqs: most requests decoding at once (the largest batch bucket).
      max_model_len: most tokens (prompt + output + draft depth) of one request.
      page_size: tokens per KV page. prefill_chunk: tokens per request per prefill step.
      batch_buckets: the padded batch sizes the steps compile for (default: powers of two
        below ``max_num_seqs``, and ``max_num_seqs``); the largest must be ``max_num_seqs``.
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
        interpret mode off GPU) or ``"xla"``;
        see :class:`serving.runner.ArenaRunner`. The model's own kernel-routed ops (the chunked
        prefill, tree verify and commit, the MoE's routed experts) run with ``impl="xla"``
        under ``"xla"`` and ``impl="auto"`` otherwise
        (:func:`gdn_jax.models.model.set_kernel_impl`).
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
        batch_buckets: Sequence[int] | None = None,
        segment_bytes: int | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        cache: str = "arena",
        kernels: str = "auto",
    ):
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("page_size", page_size),
            ("prefill_chunk", prefill_chunk),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        if cache not in ("arena", "pools"):
            raise ValueError(f"cache must be 'arena' or 'pools', got {cache!r}")
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        if kernels == "pallas" and cache != "arena":
            raise ValueError("kernels='pallas' needs cache='arena' (the kernels read the arena)")
        if speculative is not None and not isinstance(speculative, SpecConfig):
            raise ValueError(f"speculative must be a SpecConfig or None, got {speculative!r}")
        if batch_buckets is None:
            batch_buckets = buckets_for(max_num_seqs)
        batch_buckets = tuple(sorted(int(b) for b in batch_buckets))
        if not batch_buckets or batch_buckets[0] < 1 or batch_buckets[-1] != max_num_seqs:
            raise ValueError(
                f"batch_buckets must be positive sizes ending at max_num_seqs={max_num_seqs}, "
                f"got {batch_buckets}"
            )
        jdtype = jnp.dtype(dtype)
        self.model = _with_kernel_impl(load_model(model, jdtype, seed), kernels)
        self.config = self.model.config
        self.speculative = speculative
        self.tokenizer = _tokenizer_for(model)
        pages_per_seq = -(-max_model_len // page_size)
        n = speculative.num_nodes if speculative else 1
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = _with_kernel_impl(
                load_model(speculative.draft_model, jdtype, seed + 1), kernels
            )
            if draft.config.vocab_size != self.config.vocab_size:
                raise ValueError(
                    f"draft_model: vocab_size {draft.config.vocab_size} != target's "
                    f"{self.config.vocab_size}"
                )
        layout = layout_for(self.config.to_hf_dict(), page_size, spec_nodes=n, kv_dtype=dtype)
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
            layout = dataclasses.replace(
                layout, draft=layout_for(draft.config.to_hf_dict(), page_size, spec_nodes=1)
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
        self.manager = MemoryManager(
            layout, int(memory_budget), memory_policy, segment_bytes=segment_bytes
        )
        self.layout = layout
        self.spec_bytes_per_request = spec_units * layout.unit_bytes(spec_kind) if spec_kind else 0
        # a kv handle holds tokens_per_page tokens (more than page_size under unified_padded)
        page_size = self.manager.tokens_per_page
        pages_per_seq = -(-max_model_len // page_size)
        num_pages = max_num_seqs * pages_per_seq
        if cache == "arena":
            self.runner = ArenaRunner(self.model, self.manager, kernels=kernels)
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
            draft_kernels = "auto" if kernels == "pallas" else kernels
            draft_runner = ArenaRunner(draft, self.manager, kernels=draft_kernels, draft=True)
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
            spec=speculative,
            drafter=drafter,
            draft_runner=draft_runner,
        )
        self.max_model_len = pages_per_seq * page_size

    def compiled_programs(self) -> int:
        """Jitted programs compiled so far (constant in a steady state)."""
        return self.engine.compiled()

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]] | Sequence[str] | str,
        sampling_params: SamplingParams | None = None,
        *,
        progress=None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (token ids, or text when the model has a tokenizer);
        returns one :class:`RequestOutput` per prompt, in order. ``progress(n)`` is called with
        the number of tokens emitted at each step."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {params!r}")
        prompts = self._encode(prompt_token_ids)
        start = time.perf_counter()
        reqs = [
            Request(index=i, rid=("req", next(_ids)), prompt=p, params=params, arrival=start)
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            self.scheduler.add(r)
        self.engine.progress = progress
        while self.scheduler.waiting or self.scheduler.running:
            self.engine.step()
        return [self._output(r) for r in reqs]

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("prompt_token_ids: text prompts need a model tokenizer")
                p = self.tokenizer.encode(p)
            p = [int(t) for t in np.asarray(p, np.int64).reshape(-1)]
            if not p:
                raise ValueError(f"prompt_token_ids[{i}] is empty")
            if min(p) < 0 or max(p) >= self.config.vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{i}] has ids outside [0, {self.config.vocab_size})"
                )
            out.append(p)
        if not out:
            raise ValueError("prompt_token_ids: no prompts")
        return out

    def _output(self, r: Request) -> RequestOutput:
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
        text = self.tokenizer.decode(r.output) if self.tokenizer else None
        return RequestOutput(r.index, list(r.prompt), list(r.output), metrics, text)


def _tokenizer_for(model: Any):
    """The byte tokenizer for the shipped tiny models (``"tokenizer": "bytes"`` in their
    config.json), an HF ``tokenizer.json`` through ``tokenizers`` when present, else None."""
    if not isinstance(model, str | Path) or not Path(model).is_dir():
        return None
    path = Path(model)
    conf = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if conf.get("tokenizer") == "bytes":
        from serving.tokenizer import ByteTokenizer

        return ByteTokenizer()
    if (path / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))

        class _HF:
            def encode(self, text):
                return tok.encode(text).ids

            def decode(self, ids):
                return tok.decode(list(ids))

        return _HF()
    return None
