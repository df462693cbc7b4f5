#!/usr/bin/env bash
# Ready for the next H200 session (not run yet): the verify grid cells session 3 did not reach
# (N 8 and N 128 rows; an N = 128 kernel compiles for ~30 s), the chunk prefill against fla at
# T 16384 with the GPU filled, and the arena decode kernel's first GPU run (engine tests).
# Run from the repository root with `.whl` carried (fla-core 0.6.0); about 9 minutes.
set -u
source "$(dirname "$0")/h200_lib.sh"
TAILN=6 step 90 engine python3 -m pytest -x -q -p no:cacheprovider tests/serving/test_arena_kernels_engine.py \
  tests/pallas_kernels/test_arena_decode.py
TAILN=30 step 240 grid python3 benchmarks/kernels.py --ops verify --reps 5 --chains \
  --verify-blocks precision=bf16x3 --configs \
  "32:1:8;32:1:32;64:16:8;32:64:8;64:64:8;64:64:32;32:64:32;32:1:128;64:1:128;64:16:128;32:64:128;64:64:128" \
  --json "$OUT/grid3.json"
TAILN=20 step 200 chunk python3 benchmarks/kernels.py --ops chunk --chunk-shapes "16384x4;4096x1" --reps 5 \
  --no-chunk-v1 --no-xla --chunk-v2-blocks h_bf16=true,store_t=true --chunk-v2-blocks store_t=true \
  --json "$OUT/chunk.json"
