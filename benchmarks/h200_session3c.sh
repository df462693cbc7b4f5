#!/usr/bin/env bash
# The third session's last H200 call (issues 3 and 5), from the repository root: the commit and
# the arena kernels against the dense ones, the rest of the verify grid (N <= 64), the chunk
# prefill kernel by kernel, the launch cost of a Pallas call, routes_check, and the engine's
# arena-kernel tests on the GPU.
set -u
source "$(dirname "$0")/h200_lib.sh"
TAILN=20 step ${CHUNK_S:-180} chunk python3 benchmarks/chunk_breakdown.py --shapes "4096x8;16384x1" --blocks "h_bf16=true" --blocks "h_bf16=true,store_t=true" --blocks "fuse_out=true,store_t=true" --blocks "fuse_out=true,store_t=true,block_v_state=16" --blocks "h_bf16=true,store_t=true,precision=bf16" --budget-s 140 --json "$OUT/chunk_breakdown.json"
TAILN=40 step 100 commit_arena python3 benchmarks/kernels.py --ops commit,arena --reps 5 \
  --configs "32:16:64;64:1:64;64:16:64;32:64:64" --verify-blocks precision=bf16x3 \
  --commit-blocks "" --commit-blocks block_v=128,num_warps=4 --json "$OUT/commit_arena.json"
TAILN=10 step 80 engine python3 -m pytest -x -q -p no:cacheprovider tests/serving/test_arena_kernels_engine.py
TAILN=12 step 60 routes python3 -m benchmarks.routes_check --nodes 16,64 --json "$OUT/routes.json"
TAILN=20 step 40 probe python3 benchmarks/overhead_probe.py --configs "32:16:64;64:1:64" --rs 1,4,16 \
  --reps 10 --ops pallas_copy,xla_copy,pallas_tiny,xla_tiny --json "$OUT/probe_tiny.json"
TAILN=30 step ${GRID_S:-100} grid python3 benchmarks/kernels.py --ops verify --reps 5 --chains \
  --verify-blocks precision=bf16x3 --configs \
  "32:1:64;64:64:64;64:1:32;64:16:32;64:1:8;32:64:32;32:1:32;64:64:32" --json "$OUT/grid2.json"
