#!/usr/bin/env bash
# The third session's verify grid on the H200 (issue 3), from the repository root:
#   1. a variant sweep at the two target shapes (B 16 / Hv 32 and B 1 / Hv 64, N 64);
#   2. the grid Hv {32, 64} x B {1, 16, 64} x N {8, 32, 64, 128}, random trees + chains, with the
#      two main variants, in priority order (the JSON is rewritten after every row).
set -u
source "$(dirname "$0")/h200_lib.sh"
A=precision=bf16x3
B=precision=bf16x3,ancestors_input=true
step 170 sweep python3 benchmarks/kernels.py --ops verify --configs "32:16:64;64:1:64" --reps 5 \
  --chains --verify-blocks $A --verify-blocks $B \
  --verify-blocks $B,refine_steps=1 --verify-blocks $B,num_warps=8 \
  --verify-blocks $B,inverse_precision=tf32,refine_steps=1 --json "$OUT/sweep.json"
TAILN=60 step ${GRID_S:-400} grid python3 benchmarks/kernels.py --ops verify --reps 5 --chains \
  --verify-blocks $A --verify-blocks $B --configs \
  "64:16:64;32:64:64;32:16:32;32:16:8;32:16:128;64:1:128;64:1:8;64:1:32;32:1:64;64:64:64;64:16:128;64:16:32;32:64:128;32:1:8;32:1:32;32:1:128;64:16:8;32:64:8;32:64:32;64:64:8;64:64:32;64:64:128" \
  --json "$OUT/grid.json"
