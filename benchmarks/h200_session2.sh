#!/usr/bin/env bash
# The second session's H200 call (issue 3 and 5 figures in benchmarks/README.md), run through the
# device tool from the repository root with `.whl` carried (fla-core):
#   chunk prefill (Pallas one-kernel chunk 32, three-kernel chunk 64, XLA, fla), the auto routes
#   against XLA, arena reads vs native arrays, and Nsight Compute on the verify kernel.
# Writes logs and JSON under $OUT.
set -u
source "$(dirname "$0")/h200_lib.sh"
step 240 chunk python3 benchmarks/kernels.py --ops chunk --chunk-shapes "4096x1;4096x8" --reps 5 \
  --chunk-v2 --chunk-v2-blocks "" --chunk-v2-blocks h_bf16=true --json "$OUT/chunk.json"
step 70 routes python3 -m benchmarks.routes_check --json "$OUT/routes.json"
step 80 arena python3 benchmarks/arena_read.py --config benchmarks/configs/qwen3_5_35b_a3b.json \
  --json "$OUT/arena.json"
step 120 ncu ncu --clock-control none -k regex:gdn_tree_verify -c 4 --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  python3 benchmarks/verify_once.py "precision=bf16x3,stop_after=load" "precision=bf16x3"
