#!/usr/bin/env bash
# The third session's short last call: the engine's arena-kernel tests on the GPU and the arena
# kernels against the dense ones (issue 5).
set -u
source "$(dirname "$0")/h200_lib.sh"
TAILN=4 step 60 engine python3 -m pytest -x -q -p no:cacheprovider tests/serving/test_arena_kernels_engine.py
TAILN=8 step 110 arena python3 benchmarks/kernels.py --ops arena --reps 5 --configs "32:16:64;64:1:64" \
  --verify-blocks precision=bf16x3 --json "$OUT/arena.json"
