#!/usr/bin/env bash
# Session 4, second H200 call (the first was benchmarks/h200_next.sh): the N = 128 grid cells the
# first call's limit cut, the two-kernel (split) verify against the fused one, and the arena
# decode step (XLA windows vs the Pallas decode kernel). Carry `.whl`; about 9 minutes.
set -u
source "$(dirname "$0")/h200_lib.sh"
TAILN=12 step 200 grid4 python3 benchmarks/kernels.py --ops verify --reps 5 --chains \
  --verify-blocks precision=bf16x3 --configs "64:1:128;64:16:128;32:64:128;64:64:128" \
  --json "$OUT/grid4.json"
TAILN=30 step 200 split python3 benchmarks/kernels.py --ops verify --reps 5 --no-snapshot --no-xla \
  --verify-blocks precision=bf16x3 --verify-split precision=bf16x3 \
  --verify-split precision=bf16x3,block_v=128,num_warps_b=8 --verify-split precision=bf16x3,num_warps_a=8 \
  --configs "32:16:64;64:1:64;32:64:64;64:16:64;32:16:32;64:1:64" --json "$OUT/split.json"
TAILN=8 step 150 arena_read python3 benchmarks/arena_read.py --batch 1,16,64 --reps 10 \
  --json "$OUT/arena_read.json"
