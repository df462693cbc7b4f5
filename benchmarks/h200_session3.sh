#!/usr/bin/env bash
# The third session's first H200 call (issue 3), run through the device tool from the repository
# root with `.whl` carried (fla-core): where the verify's per-call time goes (overhead_probe:
# program time against the number of ops; ncu: every kernel of one fused program), the
# block_v=32/num_warps=8 variant, and the chunk prefill against fla at larger shapes.
set -u
source "$(dirname "$0")/h200_lib.sh"
step 170 probe python3 benchmarks/overhead_probe.py --configs "32:16:64;64:1:64" --rs 1,4,16 --reps 10 \
  --verify-blocks precision=bf16x3 --verify-blocks precision=bf16x3,block_v=32,num_warps=8 \
  --json "$OUT/probe.json"
step 100 ncu_all ncu --clock-control none --metrics gpu__time_duration.sum -c 60 \
  python3 benchmarks/verify_once.py --fused 2 precision=bf16x3
grep -E '^\s+[a-zA-Z_].*\(|gpu__time_duration' "$OUT/ncu_all.log" | paste - - | awk '{print $1, $(NF)}' | tail -40
step 200 chunk python3 benchmarks/kernels.py --ops chunk --chunk-shapes "4096x8;16384x1;16384x4" --reps 5 \
  --no-chunk-v1 --no-xla --chunk-v2-blocks h_bf16=true --json "$OUT/chunk.json"
step 80 routes python3 -m benchmarks.routes_check --json "$OUT/routes.json"
