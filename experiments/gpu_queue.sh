#!/usr/bin/env bash
# Every pending GPU job of the project, in priority order, within one command of at most GPU_QUEUE_DEADLINE seconds
# (default 540: a lent GPU runs one command for at most 10 minutes). Run it first whenever a GPU is lent, from the
# repository root:
#
#   OUT=/some/empty/folder bash experiments/gpu_queue.sh            # on the GPU machine; then, here:
#   tar xzf "$OUT"/gpu_results.tar.gz                                # and commit what came back
#   bash experiments/gpu_queue.sh --list                             # what it would run, in order
#   GPU_QUEUE_DRY_RUN=1 OUT=/tmp/q bash experiments/gpu_queue.sh     # every job for one step on the CPU (CI runs it)
#
# The queue, highest priority first (each job resumable: it skips what is already done, in the tree or in $OUT):
#   t. triton (issue 67): the Triton decoding kernels compiled on the GPU: tests/test_triton_kernels.py (the CPU runs
#      it under Triton's interpreter in CI), its report in experiments/gpu_tests/test_triton_kernels.txt (skipped while
#      collab_attn/ and the test are unchanged, as below); then one layer's step (benchmarks/decode_kernels.py,
#      bfloat16, 8,192 positions, batch 1 and 32: keys only at d/4 and keys and values at a quarter of the cache, the
#      Triton rows beside the others, again at other tiles and warps, and a copy's bandwidth measured in the same
#      run); then whole models with a static cache and CUDA graphs against their twins on the present path
#      (benchmarks/decode.py --triton): GPT-2 small keys only at d/4 and cp keys and values at 1/4, batch 32 at
#      8,192, then batch 1 at 4,096 and 8,192; then SmolLM2-135M's architecture converted at 1/4 (cp, key-svd,
#      kv-svd), batch 32 at 8,192; then the prompt pass (benchmarks/decode.py --prefill: keys and values at a quarter
#      of the cache, cp and kv-svd, batches 1 and 8 at 2,048 and 8,192 tokens). Each skipped once its .json exists.
#   0. tests: the GPU-only tests (python -m pytest -q tests/test_cuda.py; their CPU twins run in CI:
#      tests/test_device_twins.py), a minute or two; the report goes to experiments/gpu_tests/test_cuda.txt, whose
#      first line names the version of the sources it tested (a hash of collab_attn/, tests/test_cuda.py and
#      tests/conftest.py): skipped while they are unchanged, run again once they change. A run that ends in failed
#      tests is a result too (committed, to be fixed).
#   1. smollm2: the key/value-cache race on SmolLM2-135M (scripts/race_smollm2.py, float32 on the GPU): every
#      conversion at 1/2, 1/4, 1/8 of the cache without retraining, fitted to the attention inputs of 262,144
#      fitting tokens (calibrated: the rotary keys, the shared values and the kv-svd latent), and distilled from the
#      original on 2,048,000 fitting tokens starting from the calibrated conversions; 128 held-out windows of 512
#      tokens per domain; resumable run by run (and within a distillation, every 25 steps). Before it (issue 65):
#      cp, tucker, key-svd and kv-svd calibrated on 65,536 tokens and fitted to the original's attention outputs
#      (fit_to_original, 300 steps per layer) and then end to end (fit_end_to_end, 64 steps, one pass over the
#      first 262,144 fitting tokens: fresh text beat passes over the calibration tokens on the CPU), cp/tucker/key-svd
#      also with their sizes chosen by measurement (--allocate), with 32 windows of 2,048 tokens per domain besides,
#      and at 1/4 each distilled on 204,800 tokens from its end-to-end start, into smollm2/gpu_fitted.
#   2. decode: benchmarks/decode.py in bfloat16, original and D~ = d/2, d/4, d/8 (issue 45): batches 1 8 32 64 at
#      contexts 1024 4096 8192 with dynamic caches, then dynamic against static (compiled, CUDA graphs) caches at
#      batches 1 and 32, context 4096 (every shape compiles once per model); keys and values at a quarter of the
#      cache through the fused kernel at batch 32, 8,192 positions (issue 55; D~ = D_v = 186, then 184, a multiple
#      of 8 as the memory-efficient kernel wants); then benchmarks/decode_kernels.py (shared values at 184)
#      (one layer's step: sdpa, explicit, compiled, flex_attention) at batch 1 and 32; each skipped once its .json
#      exists.
#   3. glue: the distilled race's GPU grid on MiniLM (refit=distill; CoLA, MRPC, STS-B, RTE; seeds 0, 1, 2):
#      activation-aware CP and pruning at 96 and 192, SVD-truncated heads at 192, 120, 96. The GLUE pipeline skips
#      finished jobs (their results.jsonl is committed) and fine-tunes each task's baseline once.
#   4. lm: the Tiny Shakespeare gpu recipe (nanoGPT's 6x6x384) with collaborative heads at d/2, d/4, d/8, seed 0
#      (the concatenated baseline is committed); train_lm.py skips finished runs.
#   5. race: the cache race on the gpu recipe (issue 44), seed by seed (0, 1, 2): at a quarter of the cache
#      collaborative keys and values (rank = value_rank = 93) and MLA (latent 192), with MQA (1/6) and GQA with
#      two key/value heads (1/3) beside them (sizes: python scripts/kv_budgets.py --recipe gpu).
#   5b. rope: the cache race with rotary positions on the gpu recipe (issue 69), seed by seed (0, 1, 2): the
#      rotary original (a Llama model of nanoGPT's sizes), then at 1/2 GQA with three key/value heads, collaborative
#      keys and values at 192/192, MLA with a latent of 352 beside its rotary key of 32, TPA at ranks 3/3 (0.547);
#      at 1/4 collaborative 96/96, MLA 160, MQA (1/6), TPA at ranks 1/1 (0.182); at 1/8 collaborative 48/48 and
#      MLA 64 (sizes: python scripts/kv_budgets.py --recipe gpu --positions rope), into
#      experiments/shakespeare_char/rope_race_gpu.
#   6. convert: the conversion race on the gpu recipe (issue 43), seed by seed (0, 1, 2): the concatenated model
#      trained and saved (experiments/kv_cache/shakespeare_gpu), then every method at 1/2, 1/4, 1/8 of its cache
#      (scripts/convert_lm.py recipe=gpu cache_fractions=...), re-trained plainly; convert_lm.py skips finished runs.
# Every job runs under `timeout` against the one deadline, so the script always ends in time and keeps what finished.
# Results are written in the tree (experiments/...) and every file a job made or changed is copied to
# $OUT/experiments/... at the end, so the copy-back above puts them where they belong. Logs: $OUT/queue_logs.
#
# Settings (environment): PYTHON (python), GPU_QUEUE_DEADLINE (540), GPU_QUEUE_JOBS (which jobs, in order:
# "triton tests smollm2 decode glue lm race rope convert"), GPU_QUEUE_DRY_RUN (1: CPU, tiny sizes, one step per job, results under $OUT
# only; the tests job runs as it is: without a GPU every test skips).
set -u
JOBS=${GPU_QUEUE_JOBS:-triton tests smollm2 decode glue lm race rope convert}
if [ "${1:-}" = "--list" ]; then
  for job in $JOBS; do
    case $job in
      triton) echo "triton: python -m pytest -q tests/test_triton_kernels.py once per version of collab_attn/ and the test; benchmarks/decode_kernels.py --device cuda --dtype bfloat16 --context 8192 --batch 1, 32 (Triton rows, a sweep of keys per tile and warps, copy bandwidth); benchmarks/decode.py --device cuda --dtype bfloat16 --caches static --triton: --ranks 192 --cache-fractions 0.25 --race-methods cp at --batches 32 --contexts 8192 and --batches 1 --contexts 4096 8192; --size smollm2 --cache-fractions 0.25 --race-methods cp key-svd kv-svd --batches 32 --contexts 8192; benchmarks/decode.py --prefill --device cuda --dtype bfloat16 --contexts 2048 8192 --batches 1 8 --ranks 192 --cache-fractions 0.25 --race-methods cp kv-svd";;
      tests) echo "tests: python -m pytest -q tests/test_cuda.py, once per version of collab_attn/ and the GPU tests";;
      smollm2) echo "smollm2: scripts/race_smollm2.py --device cuda --windows 128 --length 512 --long-length 2048 --long-windows 32 --calibration-tokens 65536 --fit-steps 300 --e2e-steps 64 --e2e-tokens 262144 --allocate --distill-tokens 204800 --distill-budgets 0.25 --methods cp tucker key-svd kv-svd (fitted, then end to end on fresh text, sizes by measurement, distilled from the end-to-end start at 1/4, into smollm2/gpu_fitted); then --distill-tokens 2048000 --calibration-tokens 262144: every rotary conversion at 1/2 1/4 1/8, without retraining, calibrated, and distilled from the calibrated ones";;
      decode) echo "decode: benchmarks/decode.py --device cuda --dtype bfloat16 --batches 1 8 32 64 --contexts 1024 4096 8192 --caches dynamic; the same at --batches 1 32 --contexts 4096 --caches dynamic static; cp keys and values at 0.25 (186) and 0.2475 (184) of the cache, --batches 32 --contexts 8192; benchmarks/decode_kernels.py --value-rank 184 --batch 1, 32";;
      glue) echo "glue: scripts/train_glue.py -m +experiment=minilm_glue refit=distill seed=0,1,2: cp-aware and prune at 96 and 192, svd at 192 120 96";;
      lm) echo "lm: scripts/train_lm.py recipe=gpu attention=collab rank=192,96,48 seed=0";;
      race) echo "race: scripts/train_lm.py recipe=gpu output_dir=experiments/shakespeare_char/kv_race_gpu seed=0,1,2: collab rank=value_rank=93, mla latent_size=192, mqa, gqa kv_heads=2";;
      rope) echo "rope: scripts/train_lm.py recipe=gpu positions=rope output_dir=experiments/shakespeare_char/rope_race_gpu seed=0,1,2: concat, gqa kv_heads=3, collab rank=value_rank=192, mla latent_size=352, tpa rank=3, collab 96/96, mla 160, mqa, tpa rank=1, collab 48/48, mla 64";;
      convert) echo "convert: scripts/train_lm.py recipe=gpu output_dir=experiments/kv_cache/shakespeare_gpu seed=0,1,2, then scripts/convert_lm.py recipe=gpu cache_fractions=[0.5,0.25,0.125] per seed";;
      *) echo "unknown job $job" >&2; exit 2;;
    esac
  done
  exit 0
fi
: "${OUT:?set OUT to the folder that receives the results}"
PYTHON=${PYTHON:-python}
DEADLINE=${GPU_QUEUE_DEADLINE:-540}
DRY=${GPU_QUEUE_DRY_RUN:-0}
START=$(date +%s)
LOGS="$OUT/queue_logs"
mkdir -p "$LOGS"
STAMP="$LOGS/.start"
touch "$STAMP"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# Seconds left before the deadline, less a margin for the copy at the end; never below 1 (`timeout 0`: no limit).
left() { local s=$(( DEADLINE - ($(date +%s) - START) - ${1:-20} )); echo $(( s > 0 ? s : 1 )); }
# Where results go: the tree on a GPU (committed layout, resumable), $OUT in a dry run (the tree stays clean).
ROOT=experiments
[ "$DRY" = 1 ] && ROOT="$OUT/dry_run"
GLUE_DIR=${GLUE_DIR:-../shared/data/glue}
LM_DATA=${LM_DATA:-../shared/data/tinyshakespeare/input.txt}

LAST_EXIT=0
run_job() {  # name command...: one job under the deadline, its output in the log; never stops the queue. LAST_EXIT:
  local name=$1; shift  # its exit status (124: out of time, also when no time was left to start it)
  if [ "$(left)" -le 1 ]; then echo "$name: skipped, no time left"; LAST_EXIT=124; return; fi
  timeout "$(left)" "$@" > "$LOGS/$name.log" 2>&1
  LAST_EXIT=$?
  echo "$name: exit $LAST_EXIT after $(( $(date +%s) - START )) s"
}

triton() {
  local out="$ROOT/gpu_tests/test_triton_kernels.txt" sources kernels="$ROOT/benchmarks/decode_kernels_triton_cuda_bfloat16"
  local models="$ROOT/benchmarks/decode_cuda_bfloat16_triton" prefill="$ROOT/benchmarks/prefill_causal_kv_cuda_bfloat16"
  sources=$({ find collab_attn -name '*.py' | LC_ALL=C sort; echo tests/conftest.py tests/test_triton_kernels.py; } \
    | xargs cat | sha1sum | cut -c1-12)
  if [ "$DRY" = 1 ]; then
    # on the CPU: the tests collected (CI runs them under Triton's interpreter), then both benchmarks at tiny sizes
    # in the interpreter (they check that the commands run; their timings measure nothing)
    run_job triton-tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py --collect-only
    run_job triton-kernels env COLLAB_ATTN_TRITON=1 TRITON_INTERPRET=1 "$PYTHON" benchmarks/decode_kernels.py \
      --batch 1 --context 16 --rank 7 --value-rank 9 --repeats 1 --warmup 0 --threads 1 --compile-backend aot_eager \
      --triton-tiles 32:4 --out "${kernels}_batch1"
    run_job triton-decode env COLLAB_ATTN_TRITON=1 TRITON_INTERPRET=1 "$PYTHON" benchmarks/decode.py --size tiny \
      --threads 1 --ranks 24 --contexts 16 --batches 1 --caches dynamic --repeats 1 --warmup 0 --triton \
      --out "${models}_batch1"
    run_job triton-prefill "$PYTHON" benchmarks/decode.py --prefill --size tiny --threads 1 --contexts 16 --batches 1 \
      --ranks 24 --cache-fractions 0.25 --race-methods cp kv-svd --repeats 1 --warmup 0 --out "$prefill"
    return
  fi
  if [ -f "$out" ] && [ "$(head -n 1 "$out")" = "sources $sources" ]; then echo "triton-tests: done before ($out)"; else
    run_job triton-tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
    if [ "$LAST_EXIT" = 0 ] || [ "$LAST_EXIT" = 1 ]; then  # as the tests job: a report only of tests that ran
      mkdir -p "$(dirname "$out")"
      { echo "sources $sources"; echo "exit $LAST_EXIT"; cat "$LOGS/triton-tests.log"; } > "$out.tmp" && mv "$out.tmp" "$out"
    fi
  fi
  for batch in 1 32; do  # one layer's step: keys only at d/4 (192), keys and values at a quarter (186)
    if [ -f "${kernels}_batch$batch.json" ]; then echo "triton-kernels-b$batch: done before"; else
      run_job "triton-kernels-b$batch" "$PYTHON" benchmarks/decode_kernels.py --device cuda --dtype bfloat16 \
        --batch $batch --context 8192 --rank 192 --value-rank 186 --repeats 50 --warmup 5 \
        --triton-tiles 16:2 32:4 32:8 64:8 --out "${kernels}_batch$batch"
    fi
  done
  local common=(--device cuda --dtype bfloat16 --caches static --triton --repeats 20 --warmup 3)
  if [ -f "${models}_batch32.json" ]; then echo "triton-decode-b32: done before"; else
    run_job triton-decode-b32 "$PYTHON" benchmarks/decode.py "${common[@]}" --ranks 192 --cache-fractions 0.25 \
      --race-methods cp --batches 32 --contexts 8192 --out "${models}_batch32"
  fi
  if [ -f "${models}_batch1.json" ]; then echo "triton-decode-b1: done before"; else
    run_job triton-decode-b1 "$PYTHON" benchmarks/decode.py "${common[@]}" --ranks 192 --cache-fractions 0.25 \
      --race-methods cp --batches 1 --contexts 4096 8192 --out "${models}_batch1"
  fi
  if [ -f "${models}_smollm2.json" ]; then echo "triton-decode-smollm2: done before"; else
    run_job triton-decode-smollm2 "$PYTHON" benchmarks/decode.py "${common[@]}" --size smollm2 --cache-fractions 0.25 \
      --race-methods cp key-svd kv-svd --batches 32 --contexts 8192 --out "${models}_smollm2"
  fi
  if [ -f "$prefill.json" ]; then echo "triton-prefill: done before"; else  # a causal prompt (issue 67, item 3)
    run_job triton-prefill "$PYTHON" benchmarks/decode.py --prefill --device cuda --dtype bfloat16 --contexts 2048 8192 \
      --batches 1 8 --ranks 192 --cache-fractions 0.25 --race-methods cp kv-svd --repeats 10 --warmup 2 --out "$prefill"
  fi
}

tests() {
  local out="$ROOT/gpu_tests/test_cuda.txt" sources
  sources=$({ find collab_attn -name '*.py' | LC_ALL=C sort; echo tests/conftest.py tests/test_cuda.py; } | xargs cat \
    | sha1sum | cut -c1-12)
  if [ -f "$out" ] && [ "$(head -n 1 "$out")" = "sources $sources" ]; then
    echo "tests: done before ($out)"
    return
  fi
  run_job tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
  # exit 0 (all passed or skipped) or 1 (some failed): the tests ran, their report is the result; anything else
  # (out of time, interrupted, not collected) leaves none, so the next queue runs them again
  if [ "$LAST_EXIT" = 0 ] || [ "$LAST_EXIT" = 1 ]; then
    mkdir -p "$(dirname "$out")"
    { echo "sources $sources"; echo "exit $LAST_EXIT"; cat "$LOGS/tests.log"; } > "$out.tmp" && mv "$out.tmp" "$out"
  fi
}

smollm2() {
  local out="$ROOT/smollm2/gpu"
  if [ ! -f "$GLUE_DIR/QNLI/dev.tsv" ] || [ ! -f "$LM_DATA" ]; then echo "smollm2: skipped, no GLUE or Tiny Shakespeare"; return; fi
  if [ "$DRY" = 1 ]; then
    # a 2-layer random Llama with SmolLM2's tokenizer: the same script, conversions and distillation in seconds
    local tiny="$OUT/tiny-llama"
    "$PYTHON" - "$tiny" <<'EOF'
import sys

import transformers

from collab_attn.models.checkpoints import resolve_model

tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("smollm2"))
config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                  num_hidden_layers=2, intermediate_size=64, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
EOF
    run_job smollm2 "$PYTHON" scripts/race_smollm2.py --fit-text mixed --model "$tiny" --out "$out" --budgets 0.5 --methods cp \
      merge-kv --windows 2 --length 16 --batch 2 --distill-tokens 64 --calibration-tokens 32 --threads 1 \
      "--glue-dir=$GLUE_DIR" \
      "--shakespeare=$LM_DATA"
    run_job smollm2 "$PYTHON" scripts/race_smollm2.py --fit-text mixed --model "$tiny" --out "$out"_fitted --budgets 0.5 --methods cp \
      kv-svd --windows 2 --length 16 --long-length 32 --long-windows 2 --batch 2 --calibration-tokens 64 \
      --fit-steps 1 --e2e-steps 1 --e2e-tokens 64 --allocate --allocation-steps 1 --allocation-tokens 32 --threads 1 "--glue-dir=$GLUE_DIR" \
      "--shakespeare=$LM_DATA"
    return
  fi
  # fitted to the original's attention outputs first (issue 65): every method calibrated and fitted the same way
  # (layer by layer, then end to end), and the keys/values sized by measurement; then the long distillation
  run_job smollm2 "$PYTHON" scripts/race_smollm2.py --fit-text mixed --out "$out"_fitted --device cuda --windows 128 --length 512 \
    --long-length 2048 --long-windows 32 --batch 8 --calibration-tokens 65536 --fit-steps 300 --e2e-steps 64 \
    --e2e-tokens 262144 --allocate --distill-tokens 204800 --distill-budgets 0.25 --methods cp tucker key-svd kv-svd "--glue-dir=$GLUE_DIR" \
    "--shakespeare=$LM_DATA"
  run_job smollm2 "$PYTHON" scripts/race_smollm2.py --fit-text mixed --out "$out" --device cuda --windows 128 --length 512 --batch 8 \
    --distill-tokens 2048000 --calibration-tokens 262144 "--glue-dir=$GLUE_DIR" "--shakespeare=$LM_DATA"
}

decode() {  # the dynamic-cache grid first (no compiling: a minute or two), then the compiled static caches at two
  local grid="$ROOT/benchmarks/decode_cuda_bfloat16_batches" static="$ROOT/benchmarks/decode_cuda_bfloat16_static"
  local fused="$ROOT/benchmarks/decode_cuda_bfloat16_fused_kv"
  if [ "$DRY" = 1 ]; then
    # the tiny model, its static step captured whole without generating kernels (inductor's CPU kernels for it are
    # tests/test_static_cache.py's)
    run_job decode "$PYTHON" benchmarks/decode.py --size tiny --threads 1 --ranks 24 --contexts 16 --batches 1 \
      --caches dynamic static --compile-backend aot_eager --repeats 1 --warmup 0 --out "$grid"
  else
    if [ -f "$grid.json" ]; then echo "decode: done before ($grid.json)"; else
      run_job decode "$PYTHON" benchmarks/decode.py --device cuda --dtype bfloat16 --batches 1 8 32 64 \
        --contexts 1024 4096 8192 --caches dynamic --repeats 20 --warmup 3 --out "$grid"
    fi
    # shapes (each batch x context compiles once per model, about half a minute each)
    if [ -f "$static.json" ]; then echo "decode-static: done before ($static.json)"; else
      run_job decode-static "$PYTHON" benchmarks/decode.py --device cuda --dtype bfloat16 --batches 1 32 \
        --contexts 4096 --caches dynamic static --repeats 20 --warmup 3 --out "$static"
    fi
    # issue 55: keys and values shared through the fused kernel, batch 32 at 8k: D~ = D_v = 186 (a quarter of the
    # cache, done: sdpa's math kernel, the width not a multiple of 8) and 184 (the memory-efficient kernel's widths)
    if [ -f "$fused.json" ]; then echo "decode-fused: done before ($fused.json)"; else
      run_job decode-fused "$PYTHON" benchmarks/decode.py --device cuda --dtype bfloat16 --batches 32 \
        --contexts 8192 --ranks 192 --cache-fractions 0.25 --race-methods cp --caches dynamic static --repeats 20 \
        --warmup 3 --out "$fused"
    fi
    if [ -f "${fused}184.json" ]; then echo "decode-fused-184: done before (${fused}184.json)"; else
      run_job decode-fused-184 "$PYTHON" benchmarks/decode.py --device cuda --dtype bfloat16 --batches 1 32 \
        --contexts 8192 --ranks 192 --cache-fractions 0.2475 --race-methods cp --caches dynamic static \
        --repeats 20 --warmup 3 --out "${fused}184"
    fi
  fi
  for batch in 1 32; do  # one layer's step five ways (sdpa, explicit, compiled, flex), at 8k context
    local kernels="$ROOT/benchmarks/decode_kernels_kv184_cuda_bfloat16_batch$batch"  # shared values, D_v = 184
    if [ "$DRY" = 1 ]; then
      # tests/test_benchmarks.py's shapes, the compiled variants captured without generating kernels
      [ "$batch" = 1 ] && run_job decode-kernels "$PYTHON" benchmarks/decode_kernels.py --batch 2 --context 64 \
        --rank 48 --value-rank 40 --repeats 1 --warmup 0 --threads 1 --compile-backend aot_eager --out "$kernels"
    elif [ ! -f "$kernels.json" ]; then
      run_job "decode-kernels-b$batch" "$PYTHON" benchmarks/decode_kernels.py --device cuda --dtype bfloat16 \
        --batch $batch --context 8192 --value-rank 184 --repeats 50 --warmup 5 --out "$kernels"
    fi
  done
}

glue() {
  if [ ! -d "$GLUE_DIR" ]; then echo "glue: skipped, no GLUE data at $GLUE_DIR"; return; fi
  local common=(+experiment=minilm_glue "data.glue_dir=$GLUE_DIR" refit=distill logger=none "output_root=$ROOT/minilm_glue")
  if [ "$DRY" = 1 ]; then
    run_job glue "$PYTHON" scripts/train_glue.py "${common[@]}" task=rte seed=0 collab.calibration=task collab.rank=96 \
      trainer=smoke trainer.max_steps=1 refit.max_steps=1 refit.per_device_train_batch_size=8 data.max_seq_length=32 \
      data.max_train_samples=16 data.max_eval_samples=16 collab.n_iter_max=2 collab.calibration_samples=8
    return
  fi
  local tasks=cola,mrpc,stsb,rte
  run_job glue-cp "$PYTHON" scripts/train_glue.py -m "${common[@]}" task=$tasks seed=0,1,2 collab.calibration=task \
    collab.rank=96,192
  run_job glue-prune "$PYTHON" scripts/train_glue.py -m "${common[@]}" task=$tasks seed=0,1,2 collab=prune \
    collab.rank=96,192
  run_job glue-svd "$PYTHON" scripts/train_glue.py -m "${common[@]}" task=$tasks seed=0,1,2 collab=svd \
    collab.rank=192,120,96
}

lm() {
  if [ ! -f "$LM_DATA" ]; then echo "lm: skipped, no Tiny Shakespeare at $LM_DATA"; return; fi
  local common=("data.path=$LM_DATA" progress=false checkpoint_every=null "save_models=[]")
  if [ "$DRY" = 1 ]; then
    run_job lm "$PYTHON" scripts/train_lm.py "${common[@]}" output_dir="$ROOT/shakespeare_char/gpu" attention=collab \
      rank=8 seed=0 model.n_layer=1 model.n_head=2 model.n_embd=16 block_size=16 eval_iters=2 \
      trainer.max_steps=1 trainer.eval_steps=1 trainer.logging_steps=1 trainer.warmup_steps=0 sample_chars=10 threads=1
    return
  fi
  for key in 192 96 48; do
    run_job "lm-collab-k$key" "$PYTHON" scripts/train_lm.py recipe=gpu "${common[@]}" \
      output_dir="$ROOT/shakespeare_char/gpu" attention=collab rank=$key seed=0
  done
}

race() {
  if [ ! -f "$LM_DATA" ]; then echo "race: skipped, no Tiny Shakespeare at $LM_DATA"; return; fi
  local common=("data.path=$LM_DATA" progress=false checkpoint_every=null "save_models=[]"
                output_dir="$ROOT/shakespeare_char/kv_race_gpu")
  if [ "$DRY" = 1 ]; then
    run_job race "$PYTHON" scripts/train_lm.py "${common[@]}" attention=collab rank=6 value_rank=6 seed=0 \
      model.n_layer=1 model.n_head=2 model.n_embd=16 block_size=16 eval_iters=2 trainer.max_steps=1 \
      trainer.eval_steps=1 trainer.logging_steps=1 trainer.warmup_steps=0 sample_chars=10 threads=1
    return
  fi
  for seed in 0 1 2; do
    for variant in "attention=collab rank=93 value_rank=93" "attention=mla latent_size=192" "attention=mqa" \
                   "attention=gqa kv_heads=2"; do
      # shellcheck disable=SC2086  # the variant's settings are separate arguments
      run_job "race-$(echo $variant | tr ' =' '_-')-seed$seed" "$PYTHON" scripts/train_lm.py recipe=gpu \
        "${common[@]}" $variant seed=$seed
    done
  done
}

rope() {
  if [ ! -f "$LM_DATA" ]; then echo "rope: skipped, no Tiny Shakespeare at $LM_DATA"; return; fi
  local common=("data.path=$LM_DATA" progress=false checkpoint_every=null "save_models=[]" positions=rope
                output_dir="$ROOT/shakespeare_char/rope_race_gpu")
  if [ "$DRY" = 1 ]; then
    run_job rope "$PYTHON" scripts/train_lm.py "${common[@]}" attention=tpa rank=1 seed=0 \
      model.n_layer=1 model.n_head=2 model.n_embd=16 block_size=16 eval_iters=2 trainer.max_steps=1 \
      trainer.eval_steps=1 trainer.logging_steps=1 trainer.warmup_steps=0 sample_chars=10 threads=1
    return
  fi
  for seed in 0 1 2; do
    for variant in "attention=concat" "attention=gqa kv_heads=3" "attention=collab rank=192 value_rank=192" \
                   "attention=mla latent_size=352" "attention=tpa rank=3" \
                   "attention=collab rank=96 value_rank=96" "attention=mla latent_size=160" "attention=mqa" \
                   "attention=tpa rank=1" "attention=collab rank=48 value_rank=48" \
                   "attention=mla latent_size=64"; do
      # shellcheck disable=SC2086  # the variant's settings are separate arguments
      run_job "rope-$(echo $variant | tr ' =' '_-')-seed$seed" "$PYTHON" scripts/train_lm.py recipe=gpu \
        "${common[@]}" $variant seed=$seed
    done
  done
}

convert() {
  if [ ! -f "$LM_DATA" ]; then echo "convert: skipped, no Tiny Shakespeare at $LM_DATA"; return; fi
  local out="$ROOT/kv_cache/shakespeare_gpu" recipe=(recipe=gpu) train=() sizes=() width=384
  local methods="methods=[none,cp,cp-aware,svd,kv-svd,kv-svd-aware,prune]"
  if [ "$DRY" = 1 ]; then
    recipe=() width=16 methods="methods=[cp,kv-svd]"
    sizes=(model.n_layer=1 model.n_head=2 model.n_embd=16 block_size=16 eval_iters=2 trainer.warmup_steps=0 threads=1)
    train=(trainer.max_steps=2 trainer.eval_steps=1 trainer.logging_steps=1)  # re-training: ceil(0.1 x 2) = 1 step
  fi
  for seed in 0 1 2; do
    run_job "convert-train-seed$seed" "$PYTHON" scripts/train_lm.py "${recipe[@]}" "${sizes[@]}" "${train[@]}" \
      "data.path=$LM_DATA" progress=false output_dir="$out" attention=concat seed=$seed 'save_models=["concat-*"]' \
      sample_chars=10
    run_job "convert-seed$seed" "$PYTHON" scripts/convert_lm.py "${recipe[@]}" "${sizes[@]}" "${train[@]}" \
      "data.path=$LM_DATA" progress=false train_dir="$out" model_dir="$out/models/concat-k$width-seed$seed" \
      seed=$seed output_dir="$out/convert/seed$seed" "$methods" 'cache_fractions=[0.5,0.25,0.125]' sample_chars=10
    [ "$DRY" = 1 ] && return
  done
}

{ nvidia-smi || true; "$PYTHON" -c "import torch, transformers; print(torch.__version__, transformers.__version__, \
torch.cuda.is_available())"; } > "$LOGS/environment.txt" 2>&1
for job in $JOBS; do
  case $job in
    triton|tests|smollm2|decode|glue|lm|race|rope|convert) $job;;
    *) echo "unknown job $job" >&2; exit 2;;
  esac
done

# Everything a job made or changed in the tree (checkpoints and models stay behind), with the logs, in one archive:
# $OUT/gpu_results.tar.gz (a device machine returns a few files near the top of $OUT, not a tree).
if [ "$DRY" != 1 ]; then
  find experiments -type f -newer "$STAMP" ! -path '*/finetuned/*' ! -path '*/.checkpoints/*' ! -path '*/models/*' \
    ! -path '*/hydra/*' ! -path '*/wandb/*' ! -name '*.log' > "$LOGS/results.txt"
  tar czf "$OUT/gpu_results.tar.gz" -T "$LOGS/results.txt" -C "$OUT" queue_logs
fi
echo "queue finished after $(( $(date +%s) - START )) s"
