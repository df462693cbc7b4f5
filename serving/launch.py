"""How the engine's step programs launch their kernels on a GPU: as CUDA graphs or one by one.

XLA runs a GPU program as one CUDA graph (a command buffer) by default. Before a call it
re-records, on the host, the graph's commands whose buffer allocations moved since the last
call (about 5-7 us a command on the H200 machine; the device waits for it), and replays the
graph as recorded otherwise. The allocations stay put when a step's outputs are released
before the next step is dispatched, as the engine does (it reads a step's tokens, then drops
its outputs): then the graph replays without re-recording. Measured on the whole
Qwen3.5-35B-A3B (40 layers, ``benchmarks/model_step.py``; ``model_step/h200_launch_graphs*.json``
in ``benchmarks/results``): decode at 1, 16 and 64 rows takes 5.4, 8.6 and 15.8 ms as graphs;
16 and 64 rows launched kernel by kernel take 12.6 and 17.8 ms (the host's launches, 7-14 us
each, overlap the device's work but bound the step). With the previous step's outputs kept
alive while the next is dispatched, the graphs re-record every call and take 11.6, 11.7 and
22.9 ms.

So every step runs as a graph by default; a bound ``graph_tokens`` (rows x tokens per row;
:class:`ByTokens`) launches larger steps kernel by kernel instead, for a caller that holds
step outputs across steps. Either way the executable takes the GPU's exclusive lock
(``xla_gpu_require_exclusive_lock``, which makes re-recording a graph cheaper: 10-15%); the
engine drives each device from one thread.

XLA's rematerialization pass is off for these programs (``xla_disable_hlo_passes``; not on a
TPU). XLA:GPU gives it a memory limit of 80% of the device's memory less the program's inputs
and outputs, and 0 when those exceed it, as the weights and the preallocated arena always do on
a device the engine fills. The pass then cloned small fusions all through the step (the
40-layer 35B decode at batch 1 ran its router projection twice a layer) and saved no memory
(79.71 GiB before and after, in XLA's own log); the engine instead sizes its arena to leave the
programs' temporaries room and checks each program's fit before its first launch
(:func:`check_fits`).

These are compiler options of the programs alone (no process-wide ``XLA_FLAGS``), and other
backends ignore them.
"""

from __future__ import annotations

import jax
import numpy as np

from serving.memory.arena import free_bytes

DEFAULT_GRAPH_TOKENS = None  # LLM(cuda_graph_max_tokens=): the largest graph step (None: all)

GRAPHS = {"xla_gpu_require_exclusive_lock": True}
NO_GRAPHS = {**GRAPHS, "xla_gpu_enable_command_buffer": ""}
NO_REMAT = {"xla_disable_hlo_passes": "rematerialization"}
REMAT_OFF = True  # module switch for A/B runs (benchmarks.model_step --xla-remat)


def options(graphs: bool) -> dict:
    """The compiler options of a step program: :data:`GRAPHS` or :data:`NO_GRAPHS`, and
    :data:`NO_REMAT` unless on a TPU (whose compiler's rematerialization is left alone)."""
    opts = dict(GRAPHS if graphs else NO_GRAPHS)
    if REMAT_OFF and jax.default_backend() != "tpu":
        opts.update(NO_REMAT)
    return opts


def jit(fn, **kwargs) -> ByTokens:
    """``jax.jit(fn, **kwargs)`` as a CUDA graph whatever its size, with the engine's launch
    options."""
    return ByTokens(fn, None, 0, **kwargs)


class ByTokens:
    """A step function jitted twice: a CUDA graph for calls of at most ``graph_tokens`` tokens
    (the size of positional argument ``tokens_arg``, or ``count(args)`` for packed inputs;
    ``None``: every call), kernels launched one by one above.

    Each variant compiles only when first called, so a bucket compiles once. Called inside
    another trace (``jax.make_jaxpr``, an enclosing ``jit``) it is a plain ``jax.jit``: compiler
    options belong to the outermost program. Quacks like a jitted function for the engine's
    bookkeeping: ``lower`` and ``_cache_size``."""

    def __init__(
        self,
        fn,
        graph_tokens: int | None,
        tokens_arg: int,
        *,
        count=None,
        **jit_kwargs,
    ):
        if graph_tokens is not None and graph_tokens < 0:
            raise ValueError(f"graph_tokens must be >= 0, got {graph_tokens}")
        self.graph_tokens, self.tokens_arg = graph_tokens, tokens_arg
        self.count = count
        self.fn = fn  # the step function itself (to wrap in another program)
        self.graphs = jax.jit(fn, compiler_options=options(True), **jit_kwargs)
        self.kernels = jax.jit(fn, compiler_options=options(False), **jit_kwargs)
        self.traced = jax.jit(fn, **jit_kwargs)
        self._checked: set = set()  # call signatures whose program passed check_fits

    def pick(self, args):
        tokens = args[self.tokens_arg]
        if isinstance(tokens, jax.core.Tracer):
            return self.traced
        if self.graph_tokens is None:
            return self.graphs
        n = np.size(tokens) if self.count is None else self.count(args)
        if n <= self.graph_tokens:
            return self.graphs
        return self.kernels

    def __call__(self, *args, **kwargs):
        fn = self.pick(args)
        if fn is not self.traced:
            key = (fn is self.graphs, _signature(args), _signature(tuple(kwargs.items())))
            if key not in self._checked:  # a program about to compile: will it fit?
                check_fits(fn, args, kwargs)
                self._checked.add(key)
        return fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.pick(args).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(f._cache_size() for f in (self.graphs, self.kernels, self.traced))


def _signature(args) -> tuple:
    """What tells one program of a step apart from another, cheaply: each top-level array's
    shape and dtype, a sequence's length (the weights pass as long flat lists), a static
    value itself."""
    out = []
    for a in args:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            out.append((tuple(a.shape), str(a.dtype)))
        elif isinstance(a, (list, tuple)):
            out.append(("seq", len(a), *(_signature(a) if len(a) <= 4 else ())))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append(a)
        else:
            out.append(type(a).__name__)
    return tuple(out)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


_ROOM = (
    "lower memory_budget (the arena) to leave the programs room, or max_num_seqs / "
    "batch_buckets, prefill_chunk or the speculative tree (the step's tokens)"
)


def check_fits(fn, args, kwargs) -> None:
    """Compile ``fn(*args, **kwargs)`` ahead of its first call (the call then reuses the
    executable) and raise a ``ValueError`` when what it allocates on the device (temporaries,
    and outputs not aliased to donated inputs) exceeds what the device has free: the step
    would otherwise fail in the launch with the device out of memory. A no-op where the
    backend does not report its memory."""
    leaves = [x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.Array)]
    device = next(iter(leaves[0].devices())) if leaves else jax.devices()[0]
    free = free_bytes(device)
    if free is None:
        return
    try:
        stats = fn.lower(*args, **kwargs).compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:  # XLA's autotuner times kernels on the device
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(
            f"memory_budget / max_num_seqs: compiling a step program "
            f"({getattr(fn, '__name__', 'step')}) ran out of device memory ({_size(free)} free "
            "beside the weights and the arena; XLA times kernels on the device while "
            f"compiling); {_ROOM} ({e})"
        ) from None
    if stats is None:
        return
    need = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    if need > free:
        raise ValueError(
            f"memory_budget / max_num_seqs: a step program ({getattr(fn, '__name__', 'step')}) "
            f"needs {_size(need)} of device memory for its activations "
            f"({_size(stats.temp_size_in_bytes)} temporaries), but {device} has {_size(free)} "
            f"free beside the weights and the arena; {_ROOM}"
        )
