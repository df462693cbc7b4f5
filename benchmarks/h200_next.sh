#!/usr/bin/env bash
# Ready for the next H200 session (not run yet). Three calls, `carry: [".whl"]`:
#   bash benchmarks/h200_next.sh a   # engine kernel tests, then the serving bench on XLA
#   bash benchmarks/h200_next.sh b   # the serving bench on the arena kernels, B = 1 verify spread
#   bash benchmarks/h200_next.sh c   # the arena prefill kernel against XLA windows + chunked rule
# Session 4 found that the bench compiles for ~35-70 s per engine on the GPU (four engines, no
# persistent cache on a fresh machine), so each bench gets most of a call.
set -u
source "$(dirname "$0")/h200_lib.sh"
case "${1:-a}" in
a)
  TAILN=8 step 150 engine python3 -m pytest -q -p no:cacheprovider tests/serving/test_arena_kernels_engine.py \
    tests/pallas_kernels/test_arena_attention.py tests/pallas_kernels/test_arena_decode.py \
    $(ls tests/pallas_kernels/test_arena_prefill.py 2>/dev/null)
  TAILN=10 step 400 bench_xla python3 -m serving bench --kernels xla --compile-cache "" --json "$OUT/bench_xla.json"
  ;;
b)
  TAILN=10 step 400 bench_auto python3 -m serving bench --kernels auto --compile-cache "" --json "$OUT/bench_auto.json"
  # B = 1 timings were bimodal across runs (18-20 us or 44-66 us): the same config five times
  TAILN=12 step 150 b1 python3 benchmarks/kernels.py --ops verify --reps 10 --no-snapshot --no-xla \
    --verify-blocks precision=bf16x3 --configs "64:1:64;64:1:64;64:1:64;32:1:64;32:1:64" --json "$OUT/b1.json"
  ;;
c)
  # One prefill chunk (T tokens per row) over the 30 GDN layers: the Pallas arena prefill kernel
  # (in place) against the engine's XLA path (state windows + chunked rule) and dense arrays;
  # the JSON is rewritten after every (B, T) row, so a cut run keeps what it measured.
  TAILN=12 step 240 arena_prefill python3 benchmarks/arena_read.py --step prefill --batch 1,16,64 \
    --chunk 16,64 --reps 5 --json "$OUT/arena_prefill.json"
  ;;
esac
