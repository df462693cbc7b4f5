"""What the study runs: the policies it compares, the model configs, the cells of the grid, the
presets, and the request trace of a cell.

A cell is one combination of config x prompt lengths x output lengths x arrival pattern x
budget x speculative scratch. Every policy of a cell sees the same requests (a paired
comparison) at the same byte budget.

ShareGPT-like lengths: lognormal prompt and output lengths with the means reported for
ShareGPT in the vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023, section 6.1 / Fig. 11: mean input 161.31 tokens,
mean output 337.99 tokens); the spread (sigma = 1.0) is our choice, not a published number.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

POLICIES = ("avmp", "unified_padded", "static_dual", "multi_ended")
POLICY_ARGS = {"static_dual": {"ratio": 0.9}}  # SGLang's default mamba_full_memory_ratio

# Cache geometry of the public configs (text_config of Qwen/Qwen3.5-35B-A3B and
# Qwen/Qwen3.5-397B-A17B, see benchmarks/configs), plus a tiny model. cost = (step base s,
# s per prefill token, s per verified draft node) of the scheduler's time model: H200-order
# guesses, only ratios between policies are meant to be read.
_QWEN35 = {
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
CONFIGS = {
    "tiny": {
        "config": {
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
        "cost": (2e-3, 2e-6, 1e-6),
    },
    "qwen3.5-35b": {
        "config": dict(_QWEN35, num_hidden_layers=40, linear_num_value_heads=32),
        "cost": (12e-3, 25e-6, 8e-6),
    },
    "qwen3.5-397b": {
        "config": dict(_QWEN35, num_hidden_layers=60, linear_num_value_heads=64),
        "cost": (30e-3, 90e-6, 25e-6),
    },
}
SHAREGPT_MEANS = (161.31, 337.99)  # input, output tokens (vLLM paper, see module docstring)


@dataclasses.dataclass(frozen=True)
class Cell:
    config: str
    prompt: str  # short | long | shift (short first half, long second half) | sharegpt
    output: str  # short | long | mixed | sharegpt
    arrival: str  # poisson | bursty | batch
    budget: str  # tight | loose
    spec: str  # stash (tree WY) | snapshot (per-node states)

    @property
    def name(self) -> str:
        return "/".join(dataclasses.astuple(self))


# Budgets are in state slots of the scaled layout (the first 4 layers, see scheduler.py).
_GRID = {
    "requests": 64,
    "page_size": 32,
    "spec_nodes": 8,
    "budgets": {"tight": 12, "loose": 32},
}
PRESETS = {
    "smoke": dict(
        _GRID,
        requests=24,
        cells=[
            Cell("tiny", "shift", "short", "poisson", "tight", "stash"),
            Cell("tiny", "short", "mixed", "bursty", "tight", "snapshot"),
            Cell("qwen3.5-35b", "shift", "short", "batch", "tight", "stash"),
            Cell("qwen3.5-35b", "sharegpt", "sharegpt", "poisson", "tight", "stash"),
        ],
    ),
    "full": dict(
        _GRID,
        cells=[
            Cell(*c)
            for c in itertools.product(
                CONFIGS,
                ("short", "long", "shift"),
                ("short", "long", "mixed"),
                ("poisson", "bursty", "batch"),
                ("tight", "loose"),
                ("stash", "snapshot"),
            )
        ]
        + [
            Cell(c, "sharegpt", "sharegpt", a, b, "stash")
            for c in CONFIGS
            for a in ("poisson", "bursty")
            for b in ("tight", "loose")
        ],
    ),
}


def _lognormal(rng, mean, sigma, n, lo, hi):
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.int64)


def make_requests(cell: Cell, n: int, seed: int, base_step: float) -> dict[str, np.ndarray]:
    """Arrival time, prompt and output length, and acceptance length (tokens accepted per
    verify step) of ``n`` requests. The arrival rate offers about 24 concurrent requests'
    worth of work (``base_step`` is the config's step time), more than a tight budget holds."""
    rng = np.random.default_rng(seed)
    short, long_ = _lognormal(rng, 256, 0.8, n, 16, 4096), _lognormal(rng, 2048, 0.5, n, 256, 8192)
    prompt = {
        "short": short,
        "long": long_,
        "sharegpt": _lognormal(rng, SHAREGPT_MEANS[0], 1.0, n, 4, 4096),
        "shift": np.where(np.arange(n) < n // 2, short, long_),
    }[cell.prompt]
    out_s, out_l = _lognormal(rng, 64, 0.8, n, 4, 1024), _lognormal(rng, 384, 0.5, n, 32, 2048)
    output = {
        "short": out_s,
        "long": out_l,
        "mixed": np.where(rng.random(n) < 0.5, out_s, out_l),
        "sharegpt": _lognormal(rng, SHAREGPT_MEANS[1], 1.0, n, 4, 2048),
    }[cell.output]
    accept = rng.integers(1, 5, n)
    rate = 24 / (float(np.mean(output / accept)) * base_step)
    if cell.arrival == "poisson":
        arrival = np.cumsum(rng.exponential(1 / rate, n))
    elif cell.arrival == "bursty":  # bursts of 8 requests
        bursts = np.cumsum(rng.exponential(8 / rate, -(-n // 8)))
        arrival = np.repeat(bursts, 8)[:n]
    else:  # batch: all at once
        arrival = np.zeros(n)
    return {"arrival": arrival, "prompt": prompt, "output": output, "accept": accept}
