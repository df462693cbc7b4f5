"""How the engine's step programs launch their kernels on a GPU: as CUDA graphs or one by one.

XLA runs a GPU program as one CUDA graph (a command buffer) by default. Each call re-records
the graph's kernel nodes whose buffers moved (the step's fresh inputs and outputs, its
scratch), on the host, before the graph starts: about 5-7 us a kernel on the H200 machine,
and the device waits for it. Launched one by one instead, the host's launches overlap the
device's work, but cost more per kernel (7-14 us). Measured on a Qwen3.5-35B-A3B cut to 8
layers (~250 kernels a step; ``benchmarks/model_step.py``, ``bash benchmarks/device.sh
model_step_flags``): the one-row decode step is fastest as a graph, while 16 rows and a 29-node
verify are 18-30% faster launched one by one, their kernels being long enough to hide the
launches.

So a program is compiled both ways on demand: as a graph when it runs at most
``graph_tokens`` tokens (rows x tokens per row; :class:`ByTokens`), kernel by kernel above.
Either way the executable takes the GPU's exclusive lock (``xla_gpu_require_exclusive_lock``,
which makes re-recording a graph cheaper: 10-15% on the same steps); the engine drives each
device from one thread. These are compiler options of the programs alone (no process-wide
``XLA_FLAGS``), and other backends ignore them.
"""

from __future__ import annotations

import jax
import numpy as np

DEFAULT_GRAPH_TOKENS = 8  # LLM(cuda_graph_max_tokens=): the largest step run as a CUDA graph

GRAPHS = {"xla_gpu_require_exclusive_lock": True}
NO_GRAPHS = {**GRAPHS, "xla_gpu_enable_command_buffer": ""}


def jit(fn, **kwargs) -> ByTokens:
    """``jax.jit(fn, **kwargs)`` as a CUDA graph whatever its size, with the engine's launch
    options."""
    return ByTokens(fn, None, 0, **kwargs)


class ByTokens:
    """A step function jitted twice: a CUDA graph for calls of at most ``graph_tokens`` tokens
    (the size of positional argument ``tokens_arg``; ``None``: every call), kernels launched
    one by one above.

    Each variant compiles only when first called, so a bucket compiles once. Called inside
    another trace (``jax.make_jaxpr``, an enclosing ``jit``) it is a plain ``jax.jit``: compiler
    options belong to the outermost program. Quacks like a jitted function for the engine's
    bookkeeping: ``lower`` and ``_cache_size``."""

    def __init__(self, fn, graph_tokens: int | None, tokens_arg: int, **jit_kwargs):
        if graph_tokens is not None and graph_tokens < 0:
            raise ValueError(f"graph_tokens must be >= 0, got {graph_tokens}")
        self.graph_tokens, self.tokens_arg = graph_tokens, tokens_arg
        self.graphs = jax.jit(fn, compiler_options=GRAPHS, **jit_kwargs)
        self.kernels = jax.jit(fn, compiler_options=NO_GRAPHS, **jit_kwargs)
        self.traced = jax.jit(fn, **jit_kwargs)

    def pick(self, args):
        tokens = args[self.tokens_arg]
        if isinstance(tokens, jax.core.Tracer):
            return self.traced
        if self.graph_tokens is None or np.size(tokens) <= self.graph_tokens:
            return self.graphs
        return self.kernels

    def __call__(self, *args, **kwargs):
        return self.pick(args)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.pick(args).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(f._cache_size() for f in (self.graphs, self.kernels, self.traced))
