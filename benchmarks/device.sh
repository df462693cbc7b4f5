#!/usr/bin/env bash
# The benchmarks' GPU runs (figures in benchmarks/README.md), as named steps:
#
#   bash benchmarks/device.sh STEP [STEP ...]        # from the repository root
#
# Each step writes $OUT/<benchmark>/<name>.log and, where the benchmark writes one, the JSON
# beside it: the layout of benchmarks/results/, so a run's files replace the ones there. A step
# runs under its own time limit (each fits a 600 s device call alone); its exit status and the
# log's tail are printed. fla-core wheels in .whl/ (carried to the device) are installed to
# /tmp/site first; only the `chunk` step uses them.
#
# Steps (benchmark: what):
#   gpu_tests           tests: the engine's arena-kernel tests and impl="pallas" routes, compiled
#   verify_grid         kernels: tree verify, Hv {32, 64} x B {1, 16, 64} x N {8, 32, 64}, trees
#                       and chains, against XLA, the snapshot kernel and the floor
#   verify_grid_n128    kernels: the same at N = 128, no chains (an N = 128 kernel compiles ~30 s)
#   verify_variants     kernels: VerifyBlocks variants at B 16 / Hv 32 and B 1 / Hv 64, N 64
#   verify_split        kernels: the two-kernel verify against the fused one
#   verify_mgpu         kernels: the Mosaic GPU verify (two builds) against the Triton one, trees
#                       and chains, N 64 (and 32), B 1/16/64, Hv 32/64
#   verify_b1_repeats   kernels: one B = 1 config timed five times (its spread between runs)
#   commit              kernels: tree commit, two CommitBlocks variants, against XLA
#   arena               kernels: verify and commit on states in the arena against dense states
#   overhead            kernels: per-op and per-program cost (program time fitted over R)
#   chunk               kernels: chunked prefill against fla and the floor at four shapes
#   ncu_verify          kernels: Nsight Compute on the verify kernel, cut after the loads and whole
#   chunk_breakdown     chunk_breakdown: the chunked prefill kernel by kernel
#   moe                 moe: the routed-experts block at M 1-8192 against lax.ragged_dot,
#                       ragged_dot_mgpu and the floor
#   moe_small_m         moe: the small-M kernel at M 1/4/16/64, its defaults (automatic split)
#                       against fixed splits and narrower tiles, kernel time profiled, each op
#                       on its own copy of the weights
#   moe_decode          moe: the one-launch decode kernel at M 1 and 2 against small_m, both with
#                       the shared expert's down projection (I_s 512) as the model passes it,
#                       kernel time profiled
#   moe_grouped         moe: the grouped kernel at M 464/1024/2048 and 8192, defaults against the
#                       routed 32- and 128-row tiles, kernel time profiled
#   moe_decode_shared   moe: the decode kernel at M 1 with the shared term, its rows per program
#                       (block_hs) and stages; VARIANTS (more --decode-blocks specs, space
#                       separated: e.g. "block_k=128,block_hs=128 num_warps=8")
#   moe_decode_mgpu     moe: the decode kernel's Mosaic GPU version at M 1/2/4 against the
#                       Triton one as the engine routes it, both with the shared term, kernel
#                       time profiled; ring depths 12/6/5 and no deferred wait
#   b1_profile_mgpu     model_step: decode at B 1 with the Mosaic GPU decode MoE kernel
#                       (--moe-decode-mgpu), kernels profiled; b1_profile is the other half
#   b1_profile          model_step: decode at B 1 and 16 only, every kernel profiled in launch
#                       order (~220 s)
#   model_step          model_step: the whole Qwen3.5-35B-A3B (40 layers, random bf16 weights):
#                       decode at B 1/16/64/256, a 29-node verify at B 16, four 4k-token prompts
#                       prefilled in chunks of 2048, each against its floor (~330 s); KERNELS
#                       (auto), LIMIT (580 s), ARGS (replaces those arguments)
#   arena_copies        arena_copies: whole-arena copies in each arena program, auto and xla
#   model_step_flags    model_step: Qwen3.5-35B-A3B cut to 8 layers, decode at B 1 and 16 (BATCH)
#                       and a 29-node verify, kernels profiled, under the engine's launch policy
#                       (every step a CUDA graph; its decode HLO packed into hlo_8l.tgz), graphs
#                       up to 8 tokens only, and none (GRAPHS picks; 16 GB arena)
#   dispatch            dispatch: one jitted call's host cost against its number of arguments
#   attention_splits    attention_splits: the paged attention kernel at decode, key splits against
#                       one split, accuracy against float64 first (B 1/16/64, context 512/4096)
#   layers              layers: one decoder layer of each kind at Qwen3.5-35B-A3B dims
#   serving_xla         serving: `python -m serving bench`, tiny models, XLA kernels (~250 s)
#   serving_auto        serving: the same with the arena Pallas kernels (~270 s); both report
#                       the median of REPEATS (5) timed runs per engine; METHOD (draft_model;
#                       mtp: the target's MTP head drafts, JSON h200_<kernels>_mtp); STEPS
#                       (num_scheduler_steps, 1; JSON suffix _steps<STEPS>)
#   serving_35b_8l      serving: the bench at Qwen3.5-35B-A3B's dims cut to 8 layers, random
#                       weights, n-gram drafting; DTYPE (bfloat16), KERNELS (auto), LIMIT (330 s;
#                       float32 needs ~500); JAX_DEFAULT_MATMUL_PRECISION=highest is named too;
#                       STEPS (num_scheduler_steps, 1; JSON suffix _steps<STEPS>)
#   draft_logits        draft_logits: the drafting program, XLA and auto kernels
#   spec_step           spec_step: the one-program speculative step against a decode step;
#                       KERNELS (auto; a comma list runs each), BATCH (1,8), METHOD
#                       (draft_model; comma list: draft_model,mtp), PROFILE (set: kernels
#                       profiled), SUFFIX (added to the JSON name), LIMIT (560 s each:
#                       engine build and compile take ~100 s at B 1 and over 130 s at B 8)
#   routes_check        routes_check: impl="auto" and "pallas" against "xla"
#   arena_read_decode   arena_read: a decode step's GDN states through the arena
#   arena_read_prefill  arena_read: a prefill chunk's GDN states through the arena
#   parallel_397b_shard parallel_397b: one device's TP 8 / EP 8 shard of Qwen3.5-397B-A17B
#                       (cut to 4 and 8 layers, B 1/16/64, plain and tree WY), then the table
#   serving_load        serving_load: Qwen3.5-35B-A3B, 40 layers, random bf16 weights, Poisson
#                       rate sweep with replayed drafts; one call per WORKLOAD (sharegpt) and
#                       METHODS (none; comma list), RATES optional ('sharegpt=1,4,inf'), ARGS
#                       (more arguments, e.g. '--requests 64 --batch-buckets 32 --max-num-seqs 32
#                       --headroom-gib 24'), LIMIT (560 s); the oracle continuations are cached
#                       in $OUT/serving_load/oracle (seeded from
#                       benchmarks/results/serving_load/oracle when present)
#   serving_load_policies serving_load: the memory policies on the shifting workload (tree WY)
set -u
OUT=${OUT:-/tmp/benchmarks_out}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.

# run LIMIT_S BENCHMARK NAME CMD...: CMD under a time limit into $OUT/BENCHMARK/NAME.log
run() {
  local limit=$1 bench=$2 name=$3
  shift 3
  mkdir -p "$OUT/$bench"
  echo "== $bench/$name"
  timeout "$limit" "$@" > "$OUT/$bench/$name.log" 2>&1
  echo "rc=$?"
  grep -v '^# \[' "$OUT/$bench/$name.log" | grep -v '^op=' | tail -"${TAILN:-30}"
}

# json BENCHMARK NAME: where that step's JSON goes
json() { echo "$OUT/$1/$2.json"; }

KERNELS_PY=(python3 -m benchmarks.kernels)
VERIFY=precision=bf16x3
GRID="32:1:8;32:1:32;32:1:64;32:16:8;32:16:32;32:16:64;32:64:8;32:64:32;32:64:64"
GRID+=";64:1:8;64:1:32;64:1:64;64:16:8;64:16:32;64:16:64;64:64:8;64:64:32;64:64:64"
GRID_128="32:1:128;32:16:128;32:64:128;64:1:128;64:16:128;64:64:128"

step() {
  case "$1" in
  gpu_tests)
    TAILN=15 run 560 gpu_tests h200 python3 -m pytest -q -p no:cacheprovider --durations=8 \
      tests/serving/test_arena_kernels_engine.py tests/serving/test_arena_draft.py \
      tests/gdn_jax/test_pallas_routes.py
    ;;
  verify_grid)
    TAILN=30 run 560 kernels verify_grid "${KERNELS_PY[@]}" --ops verify --reps 5 --chains \
      --verify-blocks $VERIFY --configs "$GRID" --json "$(json kernels verify_grid)"
    ;;
  verify_grid_n128)
    TAILN=12 run 560 kernels verify_grid_n128 "${KERNELS_PY[@]}" --ops verify --reps 5 \
      --verify-blocks $VERIFY --configs "$GRID_128" --json "$(json kernels verify_grid_n128)"
    ;;
  verify_variants)
    local a=$VERIFY,ancestors_input=true
    TAILN=30 run 300 kernels verify_variants "${KERNELS_PY[@]}" --ops verify --reps 5 --chains \
      --configs "32:16:64;64:1:64" --verify-blocks $VERIFY --verify-blocks $a \
      --verify-blocks $a,refine_steps=1 --verify-blocks $a,num_warps=8 \
      --verify-blocks $a,inverse_precision=tf32,refine_steps=1 \
      --json "$(json kernels verify_variants)"
    ;;
  verify_split)
    TAILN=30 run 400 kernels verify_split "${KERNELS_PY[@]}" --ops verify --reps 5 \
      --no-snapshot --no-xla --verify-blocks $VERIFY --verify-split $VERIFY \
      --verify-split $VERIFY,block_v=128,num_warps_b=8 --verify-split $VERIFY,num_warps_a=8 \
      --configs "32:16:64;64:1:64;32:64:64;64:16:64" --json "$(json kernels verify_split)"
    ;;
  verify_mgpu)
    TAILN=30 run 560 kernels verify_mgpu "${KERNELS_PY[@]}" --ops verify --reps 5 --chains \
      --verify-blocks $VERIFY --verify-mgpu "" --verify-mgpu "lhs_in_smem=false,acc_init=true" \
      --no-snapshot --configs "32:1:64;64:1:64;32:16:64;64:16:64;32:64:64;32:16:32" \
      --json "$(json kernels verify_mgpu)"
    ;;
  verify_b1_repeats)
    TAILN=12 run 150 kernels verify_b1_repeats "${KERNELS_PY[@]}" --ops verify --reps 10 \
      --no-snapshot --no-xla --verify-blocks $VERIFY \
      --configs "64:1:64;64:1:64;64:1:64;32:1:64;32:1:64" --json "$(json kernels verify_b1_repeats)"
    ;;
  commit)
    TAILN=20 run 200 kernels commit "${KERNELS_PY[@]}" --ops commit --reps 5 \
      --configs "32:16:64;64:1:64;64:16:64;32:64:64" --commit-blocks "" \
      --commit-blocks block_v=128,num_warps=4 --json "$(json kernels commit)"
    ;;
  arena)
    TAILN=8 run 200 kernels arena "${KERNELS_PY[@]}" --ops arena --reps 5 \
      --configs "32:16:64;64:1:64" --verify-blocks $VERIFY --json "$(json kernels arena)"
    ;;
  overhead)
    TAILN=20 run 300 kernels overhead "${KERNELS_PY[@]}" --ops overhead --reps 10 --rs 1,4,16 \
      --configs "32:16:64;64:1:64" --verify-blocks $VERIFY \
      --verify-blocks $VERIFY,block_v=32,num_warps=8 --json "$(json kernels overhead)"
    ;;
  chunk)
    TAILN=12 run 560 kernels chunk "${KERNELS_PY[@]}" --ops chunk --reps 5 --no-xla \
      --chunk-shapes "4096x1;4096x8;16384x1;16384x4" --chunk-blocks h_bf16=true,store_t=true \
      --chunk-blocks store_t=true --json "$(json kernels chunk)"
    ;;
  ncu_verify)
    run 200 kernels ncu_verify ncu --clock-control none -k regex:gdn_tree_verify -c 4 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats "${KERNELS_PY[@]}" --ops profile --configs 32:16:64 \
      --verify-blocks $VERIFY,stop_after=load --verify-blocks $VERIFY
    ;;
  chunk_breakdown)
    TAILN=20 run 560 chunk_breakdown h200 python3 -m benchmarks.chunk_breakdown \
      --shapes "4096x8;16384x1" --blocks h_bf16=true --blocks h_bf16=true,store_t=true \
      --blocks fuse_out=true,store_t=true --blocks fuse_out=true,store_t=true,block_v_state=16 \
      --blocks h_bf16=true,store_t=true,precision=bf16 --budget-s 450 \
      --json "$(json chunk_breakdown h200)"
    ;;
  moe_small_m)
    local old=block_i=32,block_h=64,block_kh=128,block_ki=128,num_stages=3
    TAILN=40 run 300 moe h200_small_m python3 -m benchmarks.moe --m 1,4,16,64 --paths small_m \
      --profile --sets 8 --reps 20 --small-blocks "" --small-blocks split_k=1 \
      --small-blocks $old,split_k=1 --small-blocks $old --small-blocks block_i=64,block_h=128 \
      --small-blocks target_programs=512 --json "$(json moe h200_small_m)"
    ;;
  moe_decode_shared)
    TAILN=10 run 200 moe h200_decode_shared_blocks python3 -m benchmarks.moe --m 1 --paths decode \
      --profile --sets 8 --reps 20 --shared-inter 512 --decode-blocks "" \
      --decode-blocks block_hs=128 --decode-blocks block_hs=256 --decode-blocks num_stages=2 \
      --decode-blocks block_hs=128,num_stages=2 \
      $(for v in ${VARIANTS:-}; do printf -- '--decode-blocks %s ' "$v"; done) \
      --json "$(json moe h200_decode_shared_blocks)"
    ;;
  moe_decode_mgpu)
    TAILN=24 run 300 moe h200_decode_mgpu python3 -m benchmarks.moe --m 1,2,4 \
      --paths decode,decode_mgpu --profile --sets 8 --reps 20 --shared-inter 512 \
      --decode-blocks block_hs=128 --decode-mgpu-blocks "" --decode-mgpu-blocks stages=6 \
      --decode-mgpu-blocks stages=5 --decode-mgpu-blocks defer_wait=False \
      --json "$(json moe h200_decode_mgpu)"
    ;;
  b1_profile_mgpu)
    TAILN=8 run 300 model_step h200_b1_profile_mgpu python3 -m benchmarks.model_step \
      --kernels auto --batch 1 --tree-sizes "" --prefill-prompts 0 --reps 10 --profile \
      --profile-top 40 --moe-decode-mgpu --json "$(json model_step h200_b1_profile_mgpu)"
    ;;
  b1_profile)
    TAILN=8 run 300 model_step h200_b1_profile python3 -m benchmarks.model_step --kernels auto \
      --batch 1,16 --tree-sizes "" --prefill-prompts 0 --reps 10 --profile --profile-top 40 \
      --profile-sequence ${ARGS:-} --json "$(json model_step h200_b1_profile)"
    ;;
  moe_decode)
    TAILN=20 run 240 moe h200_decode python3 -m benchmarks.moe --m 1,2 --paths decode,small_m \
      --profile --sets 8 --reps 20 --shared-inter 512 --json "$(json moe h200_decode)"
    ;;
  moe_grouped)
    local few=block_m=32,block_i=128,block_h=256,block_kh=64,block_ki=64,num_stages=4
    local many=block_m=128,block_i=128,block_h=256,block_kh=64,block_ki=64,num_warps=8,num_stages=4
    TAILN=40 run 200 moe h200_grouped python3 -m benchmarks.moe --m 464,1024,2048 \
      --paths grouped --profile --sets 4 --grouped-blocks "" --grouped-blocks $few \
      --grouped-blocks $many --json "$(json moe h200_grouped)"
    TAILN=40 run 150 moe h200_grouped_8192 python3 -m benchmarks.moe --m 8192 --paths grouped \
      --profile --sets 4 --reps 5 --grouped-blocks "" --grouped-blocks $many \
      --grouped-blocks block_m=128,block_i=128,num_warps=8 --json "$(json moe h200_grouped_8192)"
    ;;
  model_step)
    local kernels=${KERNELS:-auto}
    local margs=${ARGS:---batch 1,16,64,256 --tree-sizes 29 --prefill-prompts 4 --prefill-chunk 2048 --reps 10}
    TAILN=14 run "${LIMIT:-580}" model_step "h200_$kernels" python3 -m benchmarks.model_step \
      --kernels "$kernels" $margs --json "$(json model_step "h200_$kernels")"
    ;;
  arena_copies)
    for k in auto xla; do
      TAILN=8 run 200 arena_copies "h200_$k" python3 -m benchmarks.arena_copies --kernels "$k" \
        --json "$(json arena_copies "h200_$k")"
    done
    ;;
  model_step_flags)
    # the engine's launch policy (serving/launch.py: every step a CUDA graph) against graphs up
    # to 8 tokens and none; the default run's decode HLO dumped aside and packed into one file
    local name bound dump=/tmp/hlo_8l
    for name in ${GRAPHS:-all upto8 none}; do
      case $name in
        all) bound=() ;;
        upto8) bound=(--cuda-graph-max-tokens 8) ;;
        none) bound=(--cuda-graph-max-tokens 0) ;;
      esac
      XLA_FLAGS=$([ "$name" = all ] && echo "--xla_dump_to=$dump --xla_dump_hlo_module_re=.*decode.*") \
        TAILN=40 run "${LIMIT:-200}" model_step "h200_8l_graphs_$name" \
        python3 -m benchmarks.model_step --layers 8 --batch "${BATCH:-1,16}" --tree-sizes 29 \
        --prefill-prompts 0 --memory-budget 16e9 --reps 10 --profile "${bound[@]}" \
        --json "$(json model_step "h200_8l_graphs_$name")"
    done
    [ -d "$dump" ] && tar czf "$OUT/model_step/hlo_8l.tgz" -C "$dump" . && rm -rf "$dump"
    ;;
  attention_splits)
    TAILN=24 run 400 attention_splits h200 python3 -m benchmarks.attention_splits \
      --batch 1 16 64 --context 512 4096 --reps 10 --inner 4 --json "$(json attention_splits h200)"
    ;;
  dispatch)
    TAILN=10 run 200 dispatch h200 python3 -m benchmarks.dispatch --json "$(json dispatch h200)"
    ;;
  layers)
    TAILN=8 run 400 layers h200 python3 -m benchmarks.layers --json "$(json layers h200)"
    ;;
  serving_xla | serving_auto)
    local k=${1#serving_}
    local name="h200_$k${METHOD:+_$METHOD}${STEPS:+_steps$STEPS}"
    TAILN=8 run 400 serving "$name" python3 -m serving bench --kernels "$k" --compile-cache "" \
      --method "${METHOD:-draft_model}" --repeats "${REPEATS:-5}" \
      --num-scheduler-steps "${STEPS:-1}" --json "$(json serving "$name")"
    ;;
  serving_35b_8l)
    local dtype=${DTYPE:-bfloat16} kernels=${KERNELS:-auto}
    local name=h200_35b_8l_${dtype}_${kernels}${JAX_DEFAULT_MATMUL_PRECISION:+_$JAX_DEFAULT_MATMUL_PRECISION}${STEPS:+_steps$STEPS}
    python3 -c 'import json, sys
c = json.load(open("benchmarks/configs/qwen3_5_35b_a3b.json"))
c.pop("_source", None)
c["num_hidden_layers"] = 8
json.dump(c, open(sys.argv[1], "w"))' /tmp/qwen3_5_35b_a3b_8l.json
    TAILN=10 run "${LIMIT:-330}" serving "$name" python3 -m serving bench \
      --config /tmp/qwen3_5_35b_a3b_8l.json --dtype "$dtype" --num-prompts 16 --max-num-seqs 16 \
      --max-tokens 32 --kernels "$kernels" --compile-cache "" --num-scheduler-steps "${STEPS:-1}" \
      --json "$(json serving "$name")"
    ;;
  spec_step)
    local ks=${KERNELS:-auto}
    for k in ${ks//,/ }; do
      TAILN=6 run "${LIMIT:-560}" spec_step "h200_$k" python3 -m benchmarks.spec_step \
        --kernels "$k" --batch "${BATCH:-1,8}" --method "${METHOD:-draft_model}" --reps 50 \
        ${PROFILE:+--profile} --json "$(json spec_step "h200_$k${SUFFIX:-}")"
    done
    ;;
  draft_logits)
    for k in xla auto; do
      TAILN=6 run 200 draft_logits "h200_$k" python3 -m benchmarks.draft_logits --kernels "$k" \
        --reps 100 --json "$(json draft_logits "h200_$k")"
    done
    ;;
  moe)
    TAILN=26 run 300 moe h200 python3 -m benchmarks.moe --m 1,16,464,2048,8192 \
      --json "$(json moe h200)"
    ;;
  routes_check)
    TAILN=12 run 200 routes_check h200 python3 -m benchmarks.routes_check \
      --json "$(json routes_check h200)"
    ;;
  arena_read_decode)
    TAILN=8 run 200 arena_read decode python3 -m benchmarks.arena_read --batch 1,16,64 --reps 10 \
      --json "$(json arena_read decode)"
    ;;
  arena_read_prefill)
    TAILN=12 run 400 arena_read prefill python3 -m benchmarks.arena_read --step prefill \
      --batch 1,16,64 --chunk 16,64 --reps 5 --json "$(json arena_read prefill)"
    ;;
  parallel_397b_shard)
    TAILN=20 run 560 parallel_397b shard_h200 python3 -m benchmarks.parallel_397b shard \
      --json "$(json parallel_397b shard_h200)"
    ;;
  serving_load | serving_load_policies)
    local wl=${WORKLOAD:-sharegpt} ms=${METHODS:-none} oracle=$OUT/serving_load/oracle
    mkdir -p "$oracle"
    cp benchmarks/results/serving_load/oracle/*.json "$oracle"/ 2> /dev/null
    local args=(--preset full --oracle-dir "$oracle" --compile-cache /tmp/serving_load_xla_cache)
    local name=h200_${wl}_${ms//,/_}
    if [ "$1" = serving_load_policies ]; then
      args+=(--policies only)
      name=h200_policies
    else
      args+=(--policies no --workloads "$wl" --methods "$ms" ${RATES:+--rates "$RATES"})
    fi
    # shellcheck disable=SC2206  # ARGS: extra arguments, split on spaces
    args+=(${ARGS:-})
    TAILN=24 run "${LIMIT:-560}" serving_load "$name" python3 -m benchmarks.serving_load \
      "${args[@]}" --json "$(json serving_load "$name")"
    ;;
  *)
    echo "unknown step: $1 (the steps are listed at the top of $0)" >&2
    return 2
    ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
for s in "$@"; do
  step "$s"
done
