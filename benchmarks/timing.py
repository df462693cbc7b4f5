"""Timing and the device's ceilings, shared by the GPU benchmarks.

- :func:`timed`: seconds per call of a jitted function, back-to-back async calls rotating over
  input sets (past the L2), blocked once at the end, median over repetitions;
- :func:`measure_bandwidth`: HBM bytes per second of an elementwise pass (read + write) over
  random data: the floors' bandwidth;
- :func:`measure_matmul`: bf16 matmul flops per second: the floors' compute rate.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def timed(fn, sets, reps: int, iters: int = 30) -> float:
    """Seconds per call of ``jax.jit(fn)``: back-to-back async calls rotating over the input
    sets (past the L2), blocking once at the end; median over ``reps``."""
    f = jax.jit(fn)
    for s in sets:
        jax.block_until_ready(f(*s))
    iters = max(iters, len(sets))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = f(*sets[i % len(sets)])
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def measure_bandwidth(reps: int, size: int = 256 << 20) -> float:
    """HBM bytes per second of a jitted elementwise pass (read + write) over ``size`` f32."""
    x = jax.random.normal(jax.random.key(0), (size,), jnp.float32)
    t = timed(lambda a: a * 1.0001 + 0.5, [(x,)], reps)
    return 2 * x.nbytes / t


def measure_matmul(reps: int, n: int = 8192) -> float:
    """bf16 matmul flops per second at ``n x n x n``."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t = timed(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16), [(a, b)], reps)
    return 2 * n**3 / t
