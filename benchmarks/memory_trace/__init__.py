"""Trace-replay study of the memory policies: AVMP, the project's asymmetric paged memory,
against the ``unified_padded``, ``static_dual`` and ``multi_ended`` baselines over a grid of
cells (``python -m benchmarks.memory_trace --help``, README.md beside this file).

- ``workload``: policies, model configs, cells, presets and request traces;
- ``scheduler``: the simulated engine (:class:`~benchmarks.memory_trace.scheduler.Sim`);
- ``stats``: paired bootstrap, verdicts and the summary over cells;
- ``study``: one cell under every policy, and seed sweeps;
- ``report``: tables, JSON and plot; ``__main__``: the command line.
"""

from benchmarks.memory_trace.workload import (
    CONFIGS,
    POLICIES,
    POLICY_ARGS,
    PRESETS,
    Cell,
    make_requests,
)

__all__ = ["CONFIGS", "POLICIES", "POLICY_ARGS", "PRESETS", "Cell", "make_requests"]
