#!/usr/bin/env bash
# Session 4, third H200 call: the engine's arena kernel tests (now with the causal paged
# attention for prefill/decode, and "auto" taking the decode kernel), the last N = 128 grid
# cells (no chains: an N = 128 kernel compiles in ~30 s), and the serving bench end to end on
# the GPU with XLA and with the arena kernels. About 9 minutes.
set -u
source "$(dirname "$0")/h200_lib.sh"
TAILN=6 step 120 engine python3 -m pytest -x -q -p no:cacheprovider tests/serving/test_arena_kernels_engine.py \
  tests/pallas_kernels/test_arena_attention.py tests/pallas_kernels/test_arena_decode.py
TAILN=8 step 120 bench_xla python3 -m serving bench --kernels xla --compile-cache "" --json "$OUT/bench_xla.json"
TAILN=8 step 120 bench_auto python3 -m serving bench --kernels auto --compile-cache "" --json "$OUT/bench_auto.json"
TAILN=12 step 200 grid5 python3 benchmarks/kernels.py --ops verify --reps 5 \
  --verify-blocks precision=bf16x3 --configs "64:16:128;32:64:128;64:64:128" --json "$OUT/grid5.json"
