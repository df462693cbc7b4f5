#!/usr/bin/env bash
# H200 steps, `carry: [".whl"]` (fla-core wheels, only where a step needs them), one per call:
#   bash benchmarks/h200_next.sh a   # engine kernel tests + arena-draft tests (~390 s on the H200)
#   bash benchmarks/h200_next.sh b   # the serving bench on XLA, then on the arena kernels
#   bash benchmarks/h200_next.sh g   # B = 1 verify spread (five runs of one config)
#   bash benchmarks/h200_next.sh c   # the arena prefill kernel against XLA windows + chunked rule
#   bash benchmarks/h200_next.sh d   # the serving bench at real dims (Qwen3.5-35B cut to 8 layers)
#   bash benchmarks/h200_next.sh e   # real dims, f32: where tree WY's tokens leave plain's
#   bash benchmarks/h200_next.sh f   # real dims, f32: e's differing row (3) by dense greedy,
#                                    # with router margins and float-noise sensitivity
# Session 8 ran a and b (benchmarks/results/h200_session8/, benchmarks/README.md "Session 8"):
# a's tests took 387 s there (the arena-draft tests compile four engines each), so a no longer
# shares its call with a bench. c, e and f were done in session 7.
# d takes DTYPE (bfloat16), KERNELS (auto) and LIMIT (330 s); f32 needs LIMIT=500.
# Session 4 found that the bench compiles for ~35-70 s per engine on the GPU (four engines, no
# persistent cache on a fresh machine); session 8: 230-270 s per bench, so b holds two.
set -u
source "$(dirname "$0")/h200_lib.sh"
case "${1:-a}" in
a)
  TAILN=15 step 560 engine python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/serving/test_arena_kernels_engine.py tests/serving/test_arena_draft.py \
    tests/pallas_kernels/test_arena_attention.py tests/pallas_kernels/test_arena_decode.py \
    $(ls tests/pallas_kernels/test_arena_prefill.py 2>/dev/null)
  ;;
b)
  TAILN=8 step 280 bench_xla python3 -m serving bench --kernels xla --compile-cache "" --json "$OUT/bench_xla.json"
  TAILN=8 step 300 bench_auto python3 -m serving bench --kernels auto --compile-cache "" --json "$OUT/bench_auto.json"
  ;;
g)
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
d)
  # The serving bench at real dims: Qwen3.5-35B-A3B's text config cut to 8 layers (6 GDN, 2
  # attention, 256 experts each), random bf16 weights, n-gram drafting (a random model has no
  # trained drafter), 16 requests of 96 prompt tokens and 32 new ones, batch 16, arena kernels.
  # (../shared does not travel to the device, so the config is written here)
  cat > /tmp/qwen35_35b_8l.json <<'JSON'
{"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": true, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "mtp_num_hidden_layers": 1, "mamba_ssm_dtype": "float32", "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}, "tie_word_embeddings": false}
JSON
  TAILN=10 step "${LIMIT:-330}" "bench_35b_8l_${DTYPE:-bfloat16}" python3 -m serving bench --config /tmp/qwen35_35b_8l.json \
    --dtype "${DTYPE:-bfloat16}" --num-prompts 16 --max-num-seqs 16 --max-tokens 32 --kernels "${KERNELS:-auto}" \
    --compile-cache "" --json "$OUT/bench_35b_8l_${DTYPE:-bfloat16}.json"
  ;;
e)
  # Plain greedy against tree WY at real dims in f32 with every dot at HIGHEST; for each row that
  # differs, the dense forward's top-2 logit gap at the first differing token (near tie or bug?)
  grep '^{"model_type"' "$0" > /tmp/qwen35_35b_8l.json
  TAILN=30 JAX_DEFAULT_MATMUL_PRECISION=highest step "${LIMIT:-540}" diag_tree_divergence \
    python3 -m benchmarks.diag_tree_divergence /tmp/qwen35_35b_8l.json --prompts 16 --tokens 32 --kernels xla
  ;;
f)
  grep '^{"model_type"' "$0" > /tmp/qwen35_35b_8l.json
  TAILN=30 JAX_DEFAULT_MATMUL_PRECISION=highest step "${LIMIT:-400}" diag_dense_row \
    python3 -m benchmarks.diag_tree_divergence /tmp/qwen35_35b_8l.json --prompts 16 --tokens 21 --dense-row 3
  ;;
esac
