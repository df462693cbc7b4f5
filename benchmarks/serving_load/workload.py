"""What the benchmark runs: the methods, the workloads (request lengths and Poisson arrivals)
and the presets.

Workloads (lengths are drawn once per seed; every method and rate serves the same requests):

- ``sharegpt``: lognormal prompt and output lengths with ShareGPT's means as reported in the
  vLLM paper (mean input 161.31, mean output 337.99 tokens; section 6.1), spread
  ``sigma = 1.0`` (our choice), clipped to the preset's bounds.
- ``longctx``: prompts uniform in ``[long_min, long_max]`` (8k-32k tokens in the full preset),
  ShareGPT-like outputs.
- ``shift`` (the memory-policy comparison): the first half of the requests ShareGPT-like, the
  second half long (``shift_long``), outputs ShareGPT-like.

Arrivals are Poisson: request ``i`` arrives at ``E_i / rate`` where ``E`` is one cumulative sum
of unit exponentials per workload, so the rates of a sweep scale one arrival sequence. Rate
``inf`` submits every request at time 0 (the saturation point: offline throughput).

Prompt tokens are uniform random ids (the models have random weights, or are the tiny byte
models; the replay drafter does not look at them).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from serving.params import SpecConfig

SHAREGPT_MEANS = (161.31, 337.99)  # input, output tokens (vLLM paper, Kwon et al., SOSP 2023)
POLICIES = ("avmp", "unified_padded", "static_dual", "multi_ended")


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    spec: SpecConfig | None

    @property
    def nodes(self) -> int:
        return self.spec.num_nodes if self.spec else 1


def methods(tree=(4, 2, 2), chain: int = 4, wide: tuple[int, ...] = (8, 32, 64, 128)):
    """The compared methods by name: plain decoding, chain snapshot (vLLM / SGLang), a static
    tree verified by snapshots and by tree WY, and dynamic trees of ``N`` nodes by tree WY
    (``budget = N``, depth and branch below)."""
    ngram = dict(method="ngram")
    out = {
        "none": Method("no speculation", None),
        "chain_snapshot": Method(
            f"chain snapshot ({chain})", SpecConfig(tree=(1,) * chain, verify="snapshot", **ngram)
        ),
        "tree_snapshot": Method("tree snapshot", SpecConfig(tree=tree, verify="snapshot", **ngram)),
        "tree_wy": Method("tree WY", SpecConfig(tree=tree, verify="wy", **ngram)),
    }
    for n in wide:
        depth, branch = wide_shape(n)
        out[f"wide_wy_{n}"] = Method(
            f"wide tree WY (N {n})",
            SpecConfig(budget=n, depth=depth, branch=branch, verify="wy", **ngram),
        )
    return out


def wide_shape(n: int) -> tuple[int, int]:
    """``(depth, branch)`` of the dynamic tree of ``n`` nodes: enough levels and width that
    the expansion offers at least ``n`` nodes before pruning to the ``n`` most probable."""
    depth = 4 if n <= 16 else 5 if n <= 32 else 6
    branch = 2
    while 1 + branch + (depth - 1) * branch * branch < n:
        branch += 1
    return depth, branch


def _lognormal(rng, mean: float, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Workload:
    """``n`` requests: prompt and output lengths, prompt tokens, unit arrival times."""

    name: str
    prompt_len: np.ndarray
    output_len: np.ndarray
    prompts: list[list[int]]
    unit_arrival: np.ndarray  # cumulative unit exponentials; arrival = unit_arrival / rate

    def arrivals(self, rate: float) -> np.ndarray:
        if math.isinf(rate):
            return np.zeros_like(self.unit_arrival)
        return self.unit_arrival / rate

    def count(self, rate: float, max_span_s: float | None, min_requests: int = 32) -> int:
        """Requests served at ``rate``: all, or the first ones arriving within ``max_span_s``
        (at least ``min_requests``), so a light rate does not take hours."""
        n = len(self.prompts)
        if max_span_s is None or math.isinf(rate):
            return n
        return int(min(n, max(min_requests, np.searchsorted(self.arrivals(rate), max_span_s))))

    def params(self) -> dict:
        return {
            "requests": len(self.prompts),
            "prompt_tokens_mean": float(self.prompt_len.mean()),
            "prompt_tokens_max": int(self.prompt_len.max()),
            "output_tokens_mean": float(self.output_len.mean()),
            "output_tokens_max": int(self.output_len.max()),
        }


def make_workload(name: str, preset: dict, vocab: int, seed: int) -> Workload:
    """Workload ``name`` (``sharegpt`` | ``longctx`` | ``shift``) of ``preset``."""
    n = preset["requests"][name]
    rng = np.random.default_rng([seed, ("sharegpt", "longctx", "shift").index(name)])
    lo, hi = preset["prompt_clip"]
    share = _lognormal(rng, preset["prompt_mean"], 1.0, n, lo, hi)
    out = _lognormal(rng, preset["output_mean"], 1.0, n, *preset["output_clip"])
    if name == "sharegpt":
        prompt = share
    elif name == "longctx":
        prompt = rng.integers(preset["long_min"], preset["long_max"] + 1, n)
    elif name == "shift":
        long_ = rng.integers(*preset["shift_long"], n)
        prompt = np.where(np.arange(n) < n // 2, share, long_)
    else:
        raise ValueError(f"workload: unknown {name!r}")
    prompts = [rng.integers(1, vocab, int(p)).tolist() for p in prompt]
    unit = np.cumsum(rng.exponential(1.0, n))
    unit -= unit[0]  # the first request arrives at 0
    return Workload(name, prompt.astype(np.int64), out, prompts, unit)


# Every length in tokens; max_span_s caps a rate's arrivals (Workload.count); memory_budget in bytes or "auto" (what HBM leaves after the weights,
# see run.auto_budget). The full preset's rates are in requests / s; `inf` is the saturation
# point (benchmarks/serving_load/README.md has the H200 runs).
PRESETS = {
    "smoke": dict(
        model="tiny",
        dtype="float32",
        kernels="xla",
        requests={"sharegpt": 6, "longctx": 4, "shift": 6},
        max_span_s=None,
        prompt_mean=24,
        prompt_clip=(8, 48),
        output_mean=12,
        output_clip=(4, 24),
        long_min=64,
        long_max=96,
        shift_long=(48, 96),
        workloads=("sharegpt",),
        rates={"sharegpt": (8.0, math.inf), "longctx": (2.0, math.inf)},
        shift_rate=math.inf,
        methods=("none", "chain_snapshot", "tree_snapshot", "tree_wy"),
        tree=(2, 1, 1),
        chain=4,
        wide=(8,),
        max_num_seqs=4,
        batch_buckets=(4,),
        prefill_chunk=32,
        max_model_len=160,
        memory_budget=2 << 20,
        avmp_method="none",
        bootstrap_reps=1000,
        force_replay=False,
    ),
    "full": dict(
        model="qwen3_5_35b_a3b",
        dtype="bfloat16",
        kernels="auto",
        requests={"sharegpt": 256, "longctx": 48, "shift": 128},
        max_span_s=120.0,
        prompt_mean=SHAREGPT_MEANS[0],
        prompt_clip=(8, 4096),
        output_mean=SHAREGPT_MEANS[1],
        output_clip=(4, 2048),
        long_min=8192,
        long_max=32768,
        shift_long=(8192, 32768),
        workloads=("sharegpt", "longctx"),
        rates={
            "sharegpt": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf),
            "longctx": (0.05, 0.1, 0.2, 0.4, math.inf),
        },
        shift_rate=1.0,
        methods=(
            "none",
            "chain_snapshot",
            "tree_snapshot",
            "tree_wy",
            "wide_wy_8",
            "wide_wy_32",
            "wide_wy_64",
            "wide_wy_128",
        ),
        tree=(4, 2, 2),
        chain=4,
        wide=(8, 32, 64, 128),
        max_num_seqs=64,
        batch_buckets=(1, 4, 16, 64),
        prefill_chunk=512,
        max_model_len=32768 + 2048 + 16,
        memory_budget="auto",
        avmp_method="tree_wy",
        bootstrap_reps=2000,
        force_replay=True,
    ),
}
