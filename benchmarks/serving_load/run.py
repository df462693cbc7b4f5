"""Running the benchmark: the model and its arena budget, the oracle pass, one method at one
rate through ``LLM.add_request`` / ``LLM.step``, and the memory-policy comparison.

Clock: a step clock. Time advances by the measured wall time of each ``LLM.step()`` (host
work and the device program, which the engine waits for); when nothing is in flight it jumps
to the next arrival. A request is added before the first step that starts at or after its
arrival time, and its tokens are stamped with the time at the end of the step that emitted
them. This equals a wall clock with the idle gaps removed, so light rates cost only their busy
time. The replay drafter's host time (building each tree in Python) is left out of the step
time: it stands in for a drafter that runs on the device (its time is ``draft_host_s``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import load_config, log
from benchmarks.memory_trace.stats import paired_bootstrap
from benchmarks.serving_load.replay import ReplayDrafter, ReplayParams
from benchmarks.serving_load.workload import POLICIES, Method, Workload
from serving.bench import ASSETS
from serving.llm import LLM, load_model
from serving.memory.arena import free_bytes
from serving.params import SamplingParams

AUTO_HEADROOM = 8 << 30  # bytes of device memory left to activations under budget "auto"


def model_for(preset: dict):
    """The target: the shipped tiny model, or random weights at a config's size."""
    dtype = jnp.dtype(preset["dtype"])
    if preset["model"] == "tiny":
        return load_model(ASSETS / "target", dtype)
    _, cfg = load_config(preset["model"])
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if preset.get("num_layers"):
        cfg["num_hidden_layers"] = preset["num_layers"]
        cfg.pop("layer_types", None)
    return load_model(cfg, dtype)


def auto_budget(headroom: int = AUTO_HEADROOM) -> int:
    """Bytes of device memory left after the weights (all live buffers), less ``headroom``."""
    free = free_bytes(jax.devices()[0])
    if free is None:
        raise SystemExit("memory_budget auto: this backend reports no memory stats; give bytes")
    return free - headroom


def make_llm(model, preset: dict, method: Method, budget: int, policy: str = "avmp") -> LLM:
    return LLM(
        model,
        memory_budget=budget,
        memory_policy=policy,
        speculative=method.spec,
        max_num_seqs=preset["max_num_seqs"],
        batch_buckets=preset["batch_buckets"],
        max_model_len=preset["max_model_len"],
        prefill_chunk=preset["prefill_chunk"],
        dtype=preset["dtype"],
        kernels=preset["kernels"],
        admission=preset.get("admission", "chunk"),
    )


def warm_up(llm: LLM, preset: dict, vocab: int, replay: ReplayParams | None = None) -> float:
    """Compiles every batch bucket's programs (prefill and decode / speculative step) by
    generating for ``b`` equal prompts per bucket ``b``; returns the seconds it took. A
    speculating engine drafts with a replay drafter (``replay``; no requests registered), so
    the programs of host-built trees compile, not those of the n-gram drafter's own."""
    t0 = time.perf_counter()
    if replay is not None and llm.engine.spec is not None:
        llm.engine.drafter = ReplayDrafter(vocab, replay)
    rng = np.random.default_rng(12345)
    for b in preset["batch_buckets"]:
        prompts = [rng.integers(1, vocab, 16).tolist() for _ in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=8))
    return time.perf_counter() - t0


def cached_oracle(wl: Workload, cache: Path | None, tag: str) -> list[list[int]] | None:
    """The oracle continuations of ``wl`` from ``cache`` when it holds this workload's
    prompts for this model (``tag``), else None."""
    if cache is not None and cache.exists():
        doc = json.loads(cache.read_text())
        if doc.get("tag") == tag and doc.get("prompts_hash") == _hash(wl.prompts):
            return doc["outputs"]
    return None


def oracle_pass(llm: LLM, wl: Workload, cache: Path | None, tag: str) -> list[list[int]]:
    """Every request's greedy continuation by plain decoding (``llm`` has no speculation),
    read from / written to ``cache`` (a JSON file per workload and model) when given."""
    hit = cached_oracle(wl, cache, tag)
    if hit is not None:
        return hit
    params = [SamplingParams(max_tokens=int(n)) for n in wl.output_len]
    outs = llm.generate(wl.prompts, params)
    tokens = [o.token_ids for o in outs]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(
            json.dumps({"tag": tag, "prompts_hash": _hash(wl.prompts), "outputs": tokens})
        )
    return tokens


def _hash(prompts) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def install_replay(llm: LLM, wl: Workload, oracle, replay: ReplayParams) -> ReplayDrafter:
    drafter = ReplayDrafter(llm.config.vocab_size, replay)
    for i, (p, o) in enumerate(zip(wl.prompts, oracle, strict=True)):
        drafter.register(i, p, o)
    llm.engine.drafter = drafter
    return drafter


def _ms(x, q) -> float | None:
    """The ``q``-th percentile of ``x`` (seconds) in ms; ``None`` when empty."""
    return 1e3 * float(np.percentile(x, q)) if len(x) else None


def serve(llm: LLM, wl: Workload, rate: float, n: int, oracle, skip_first: bool = False) -> dict:
    """The first ``n`` requests of ``wl`` at ``rate`` through ``llm`` (step clock, module
    docstring; a replay drafter's host time is left out of it and reported as
    ``draft_host_s``): per-request times and tokens, and the run's counters.
    ``skip_first``: ``same_tokens_as_plain`` compares the tokens after the first (a forced
    replay: the first token is the model's own, from prefill)."""
    arrival = wl.arrivals(rate)[:n]
    rid_of: dict = {}
    first = np.full(n, np.nan)
    last = np.full(n, np.nan)
    tokens: list[list[int]] = [[] for _ in range(n)]
    rejected = np.zeros(n, bool)
    nxt, t, steps, busy = 0, 0.0, 0, 0.0
    accept: list[int] = []
    peak_running = peak_kv = peak_spec = 0
    sched, mgr = llm.scheduler, llm.manager
    pre0, mig0 = sched.preemptions, mgr.stats()["migrations"]
    migb0, comp0 = mgr.stats()["migrated_bytes"], mgr.stats()["compactions"]
    compiled0 = llm.compiled_programs()
    drafter = llm.engine.drafter if llm.engine.spec is not None else None
    draft_s = getattr(drafter, "host_s", None)
    draft0 = draft_s or 0.0
    while nxt < n or llm.has_unfinished_requests():
        if not llm.has_unfinished_requests() and arrival[nxt] > t:
            t = float(arrival[nxt])
        while nxt < n and arrival[nxt] <= t:
            params = SamplingParams(max_tokens=int(wl.output_len[nxt]))
            try:
                rid_of[llm.add_request(wl.prompts[nxt], params, index=nxt)] = nxt
            except ValueError:
                rejected[nxt] = True
            nxt += 1
        if not llm.has_unfinished_requests():
            continue
        t0 = time.perf_counter()
        outs = llm.step()
        dt = time.perf_counter() - t0
        if draft_s is not None:  # the replay drafter stands in for drafting on the device
            dt -= drafter.host_s - draft_s
            draft_s = drafter.host_s
        t += dt
        busy += dt
        steps += 1
        for o in outs:
            i = rid_of[o.request_id]
            if o.error is not None:
                rejected[i] = True
                continue
            if o.finished and o.output is not None:
                accept += o.output.metrics["acceptance_lengths"]
            if o.token_ids:
                tokens[i] += o.token_ids
                if np.isnan(first[i]):
                    first[i] = t
                last[i] = t
        s = mgr.stats()
        peak_running = max(peak_running, len(sched.running))
        peak_kv = max(peak_kv, s["kv_pages"])
        peak_spec = max(peak_spec, s["stash_units"] + s["snapshot_slots"])
    s = mgr.stats()
    done = ~rejected & ~np.isnan(last)
    ttft = (first - arrival)[done]
    ntok = np.array([len(x) for x in tokens])
    tpot = ((last - first) / np.maximum(ntok - 1, 1))[done & (ntok > 1)]
    makespan = float(np.nanmax(last) - arrival[0]) if done.any() else float("nan")
    kind = llm.scheduler.spec_kind
    k = 1 if skip_first else 0
    same = [tokens[i][k:] == list(oracle[i])[k:] for i in range(n) if done[i]]
    return dict(
        requests=n,
        completed=int(done.sum()),
        rejected=int(rejected.sum()),
        makespan_s=makespan,
        busy_s=busy,
        draft_host_s=(draft_s - draft0) if draft_s is not None else 0.0,
        steps=steps,
        request_throughput=float(done.sum() / makespan),
        token_throughput=float(ntok[done].sum() / makespan),
        ttft_p50_ms=_ms(ttft, 50),
        ttft_p99_ms=_ms(ttft, 99),
        tpot_p50_ms=_ms(tpot, 50),
        tpot_p99_ms=_ms(tpot, 99),
        peak_concurrency=peak_running,
        preemptions=sched.preemptions - pre0,
        migrations=s["migrations"] - mig0,
        migrated_bytes=s["migrated_bytes"] - migb0,
        compactions=s["compactions"] - comp0,
        spec_bytes_per_request=llm.spec_bytes_per_request,
        peak_spec_bytes=peak_spec * (llm.layout.unit_bytes(kind) if kind else 0),
        peak_kv_bytes=peak_kv * llm.layout.unit_bytes("kv"),
        arena_bytes=s["arena_bytes"],
        mean_acceptance_length=float(np.mean(accept)) if accept else 1.0,
        compiled_during_run=llm.compiled_programs() - compiled0,
        same_tokens_as_plain=float(np.mean(same)) if same else None,
        ttft_s=[None if not done[i] else float(first[i] - arrival[i]) for i in range(n)],
        latency_s=[None if not done[i] else float(last[i] - arrival[i]) for i in range(n)],
    )


def run_method(
    model, preset, method: Method, workloads, oracles, replay, budget, rates, vocab, on_row=None
):
    """One method: one engine, warmed up, through every workload and rate; rows (each also
    handed to ``on_row`` as it is measured, so a run cut short keeps what it measured)."""
    llm = make_llm(model, preset, method, budget)
    rows = []
    try:
        log(f"{method.name}: compiling")
        warm_s = warm_up(llm, preset, vocab, replay)
        for wl in workloads:
            drafter = install_replay(llm, wl, oracles[wl.name], replay) if method.spec else None
            for rate in rates[wl.name]:
                n = wl.count(rate, preset.get("max_span_s"))
                n = min(n, preset.get("serve_requests") or n)
                off0 = drafter.off_path_steps if drafter else 0
                force = replay.force and method.spec is not None
                row = serve(llm, wl, rate, n, oracles[wl.name], skip_first=force)
                row["off_path_draft_steps"] = drafter.off_path_steps - off0 if drafter else 0
                row.update(
                    method=method.name,
                    nodes=method.nodes,
                    workload=wl.name,
                    rate=rate,
                    warm_up_s=warm_s,
                    kernels=getattr(llm.runner, "kernels", preset["kernels"]),
                )
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                log(
                    f"{method.name} {wl.name} rate {rate}: {row['request_throughput']:.3g} req/s, "
                    f"TTFT p50 {row['ttft_p50_ms']} ms, accept {row['mean_acceptance_length']:.2f}"
                )
    finally:
        del llm
        gc.collect()
    return rows


def policy_study(
    model,
    preset,
    method: Method,
    wl: Workload,
    oracle,
    replay,
    budget,
    rate,
    on_row=None,
    repeats: int = 1,
):
    """The same engine, method and budget under each memory policy on one shifting workload,
    ``repeats`` times with the policies' order rotated each time (so none always runs first);
    paired-bootstrap 95% intervals of AVMP's gain in TTFT and latency against each baseline
    (mean of baseline minus AVMP over the requests both completed, each request's times
    averaged over the repeats; positive: AVMP faster), and each policy's median request
    throughput over the repeats. ``on_row(row)`` is called with each row as it is
    measured."""
    rows = []
    n = wl.count(rate, preset.get("max_span_s"))
    for rep in range(repeats):
        k = rep % len(POLICIES)
        for policy in POLICIES[k:] + POLICIES[:k]:
            llm = make_llm(model, preset, method, budget, policy)
            try:
                warm_up(llm, preset, llm.config.vocab_size, replay)
                if method.spec:
                    install_replay(llm, wl, oracle, replay)
                force = bool(replay.force and method.spec)
                row = serve(llm, wl, rate, n, oracle, skip_first=force)
            finally:
                del llm
                gc.collect()
            row.update(policy=policy, method=method.name, workload=wl.name, rate=rate, repeat=rep)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            log(
                f"policy {policy} (repeat {rep}): {row['request_throughput']:.3g} req/s, "
                f"{row['preemptions']} preemptions"
            )

    def per_request(policy: str, key: str) -> np.ndarray:
        runs = [[np.nan if x is None else x for x in r[key]] for r in rows if r["policy"] == policy]
        with warnings.catch_warnings():  # a request no repeat completed stays nan, silently
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(np.array(runs, float), axis=0)

    rng = np.random.default_rng(0)
    cis = {}
    for base in POLICIES[1:]:
        cis[base] = {}
        for key in ("ttft_s", "latency_s"):
            ci = paired_bootstrap(
                per_request("avmp", key), per_request(base, key), rng, preset["bootstrap_reps"]
            )
            cis[base][key] = (
                None if ci is None else dict(zip(("mean_gain", "lo", "hi"), ci, strict=True))
            )
    median = {
        p: float(np.median([r["request_throughput"] for r in rows if r["policy"] == p]))
        for p in POLICIES
    }
    return {
        "rows": rows,
        "repeats": repeats,
        "median_request_throughput": median,
        "avmp_gain_ci95": cis,
    }


def finite(x):
    """JSON-safe rates: ``inf`` as the string ``"inf"``."""
    return "inf" if isinstance(x, float) and math.isinf(x) else x
