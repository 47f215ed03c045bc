#!/usr/bin/env bash
# The GPU check: the performance targets (docs/performance.md) measured in one device command, most important
# first, each row skipped when its estimated time no longer fits the budget.
#   bash scripts/gpu_check.sh all --budget SECONDS [OUT_DIR]      every row, in the order below
#   bash scripts/gpu_check.sh ROW... --budget SECONDS [OUT_DIR]   the rows named (a second command: what failed)
#   bash scripts/gpu_check.sh --dry-run all|ROW... [--budget SECONDS] [OUT_DIR]   the same on the CPU at toy size
#       (CI runs it; the paper code only where PAPER_CODE names it, at DiT-S/8 then, the authors' smallest)
# Rows, with the targets they measure and the seconds they are estimated to take on one H100/H200, compilation
# included (the H200 run in docs/perf/h200_check, rounded up; flux's and xl2's from the H100 run in
# docs/perf/h100_flux_check: 149, 197 and 252 s; flux then had one compiled row; its two now, batch 1 and 2,
# compile about as much as the two of batch 1 it had since (checkpoint around and inside the graphs) and record
# CUDA graphs besides: not yet timed; b2, cuda and train raised to what an H200 run of 2026-11-28 took, whose
# files were not kept: b2 cut off at 173 s with its last stage left, cuda 129 s, train 61 s; docs/performance.md
# has the table); the estimate decides whether a row starts, and a row may run to twice it:
#   flux   240  the FLUX.1-dev LoRA fine-tune step (11.9 B parameters, bf16, 4,096 image + 512 text tokens, LoRA
#               r16, gradient checkpointing, default attention settings): routed / unrouted against the FLOP bound
#               and peak memory, eager at batch 1 and 2, then each block compiled with CUDA graphs (reduce-overhead,
#               the checkpoint inside the graphs) at batch 1 and 2, one routed step of each profiled
#               (lab.bench_diffusers --flux-lora full)
#   xl2    240  DiT-XL/2, batch 256 as 2 x 128, bf16, each block compiled (train.compile_scope=blocks, as the paper
#               code compiles): `dit` (MFU) and `tread` 2 -> 24 at 0.5 (speed-up against the FLOP bound), then the
#               paper code's two (ours / theirs, peak memory); one profiled step of each of ours; warm-up times
#   xl2static 180 as xl2, ours alone, every block graph static (train.compile_dynamic=false): by torch's default a
#               block's second shape, the routed sequence, is traced with a symbolic length and strides, and that
#               graph runs the routed blocks, the float32 block and those after the route, where `dit`'s and the
#               whole model's graphs stay static; one profiled step of each
#   xl2model 260 as xl2, ours alone, compiled as a whole model (train.compile_scope=model): the step time and
#               warm-up that block compilation is compared with, and one profiled step of each, whose kernel time by
#               category against xl2's says where the whole-model graph's `tread` step gains
#   b2     190  DiT-B/2, batch 256, bf16: as xl2 (each block compiled, the paper code's as published, ours profiled)
#               at batch 256 in one micro-batch; its whole-model numbers are the H200 run's (docs/perf/h200_check)
#   fid    130  in-training FID-5K of DiT-B/2: 40 Heun steps, SD-VAE decode, Inception, FID, each stage timed
#   cuda   130  pytest -n 0 -m cuda
#   suite  300  the ADM suite on 50,000 samples against 10,000 references: time and peak host memory
#   train   70  compiled routed training on the digits, 200 steps, an evaluation at step 100: recompiles, graphs
#   xl2bf16 200  as xl2model (the whole model compiled, as the H200 xl2 row it pairs with), with the block after
#               the route in bf16 (model.params.fp32_after_route=false): the speed-up against the FLOP bound
#               without the authors' float32 block
#   study256 240 dit against tread on the digits at 256 tokens (patch 1), seeds 0-2, 3,000 steps, the six runs side
#               by side, archived in study256.tar.gz (lab.token_study: its docstring sizes it)
#   cudnn   90  lab.cudnn_attention_fault: does cuDNN's fused attention fault in backward on this stack, and does the
#               trainer's guard (tread_utils.precision) decide right; a fault is a result, not a failed row (cudnn.json)
#   xl2fp32math 180 as xl2, ours alone, the float32 block's attention in torch's math kernel (train.attention_fp32=math:
#               TF32 batched matmuls where the default runs the memory-efficient kernel in float32)
#   xl2flash4 180 as xl2, ours alone, with FlashAttention-4 (train.attention=flash4, Hopper or newer): skipped in one
#               line where the flash-attn-4 package is not installed (`pip install -e ".[hopper]"`; its CuTe DSL
#               wheel is 92 MB, more than a device command carries)
# OUT_DIR (default $OUT, else gpu_check_out) receives, as each row ends: ROW.json (the bench record, device name
# inside), its log appended to logs.txt, and a line in summary.txt; the script's last line is the summary. At
# most 8 files, the most one device command brings back.
# The GPU image lacks hydra-core, omegaconf, antlr4, diffusers, webdataset and braceexpand: copy
# ../shared/gpu-wheels/*.whl into .whl/ (git-ignored, carried; WHEELS names another folder). For the paper's
# code put github.com/CompVis/tread's dit.py and routing_module.py in .paper-code/ (git-ignored, carried;
# PAPER_CODE names another folder); without them xl2 and b2 time ours alone and say so.
set -u
ROWS_ALL=(flux xl2 xl2static xl2model b2 fid cuda suite train xl2bf16 study256 cudnn xl2fp32math xl2flash4)
declare -A ESTIMATE=([flux]=240 [xl2]=240 [xl2static]=180 [xl2model]=260 [b2]=190 [fid]=130 [cuda]=130 [suite]=300
                     [train]=70 [xl2bf16]=200 [study256]=240 [cudnn]=90 [xl2fp32math]=180 [xl2flash4]=180)
usage() {
  echo "usage: bash scripts/gpu_check.sh [--dry-run] all|$(IFS='|'; echo "${ROWS_ALL[*]}") ... [--budget SECONDS]" \
    "[OUT_DIR]" >&2
  exit 2
}
PY=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

DRY=0 DIR="" BUDGET="" ROWS=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --budget) [[ ${2:-} =~ ^[0-9]+$ ]] || usage; BUDGET=$2; shift ;;
    all) ROWS+=("${ROWS_ALL[@]}") ;;
    -*) usage ;;
    *) if [ -n "${ESTIMATE[$1]:-}" ]; then ROWS+=("$1"); else [ -z "$DIR" ] || usage; DIR=$1; fi ;;
  esac
  shift
done
[ ${#ROWS[@]} -gt 0 ] || { echo "name the rows to run (all, or some of: ${ROWS_ALL[*]})" >&2; usage; }
[ -n "$BUDGET" ] || [ $DRY = 1 ] || { echo "give the device command's time: --budget SECONDS" >&2; usage; }
cd "$ROOT" || exit 1
OUT_DIR=$(mkdir -p "${DIR:-${OUT:-gpu_check_out}}" && cd "${DIR:-${OUT:-gpu_check_out}}" && pwd) || exit 1
END=$(( $(date +%s) + ${BUDGET:-3600} ))
export PYTHONUNBUFFERED=1
PAPER_CODE=${PAPER_CODE:-$( ((DRY)) || echo .paper-code)}  # a dry run times the paper code only if named
RES=$(mktemp -d)
trap 'rm -rf "$RES"' EXIT

# ---- sizes: the GPU check, or toy sizes on the CPU -----------------------------------------------------------
if [ $DRY = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  B2=DiT-T/8 XL2=DiT-T/8 BATCH=4 MICRO=2 STEPS=(--steps 1 --warmup 1)
  COMPILE=(--compile on --compile-backend eager --device cpu)  # dynamo traces, graphs counted; no inductor build
  FID=(--fid-samples 3 --fid-steps 2 --fid-batch 2 --vae "${BENCH_VAE:-random}" --device cpu)
  SUITE=(--suite-samples 8 --suite-ref 4 --suite-batch 4 --device cpu)
  PYTEST_CUDA=(--collect-only)
  FLUX=(--flux-lora proxy --compile off --profile --rounds 1 --steps 1)
  TRAIN=("+model.params.depth=4" "+model.params.hidden_size=32" "+model.params.num_heads=2"
         model.params.routes.0.start_layer_idx=1 model.params.routes.0.end_layer_idx=2
         train.general.batch_size=16 train.general.num_workers=0 train.eval.fid_num_samples=128
         train.eval.batch_size=64 train.eval.sampler.num_steps=2 train.max_steps=4 train.compile=false)
  STUDY=(--seeds 0 --steps 2 -- train.general.batch_size=16 train.general.num_workers=0
         train.eval.eval_interval=2 train.eval.fid_num_samples=128 train.eval.batch_size=64
         train.eval.sampler.num_steps=2 train.cpu_threads=1)
else
  B2=DiT-B/2 XL2=DiT-XL/2 BATCH=256 MICRO=128 STEPS=(--steps 5 --warmup 2)
  COMPILE=(--compile on)
  FID=(--fid-samples 5000 --fid-steps 40 --fid-batch 256)
  SUITE=(--suite-samples 50000 --suite-ref 10000 --suite-batch 250)
  PYTEST_CUDA=()
  FLUX=(--flux-lora full --batch-sizes 1 2 --compile both --compile-mode reduce-overhead --profile --rounds 3 --steps 2)
  TRAIN=(train.max_steps=200 train.compile=true)
  STUDY=(-- train.compile=true train.cpu_threads=2)
fi
PAPER=()
[ -n "$PAPER_CODE" ] && [ -f "$PAPER_CODE/dit.py" ] && PAPER=(--paper-code "$PAPER_CODE" --paper-modes published)
[ $DRY = 1 ] && [ ${#PAPER[@]} -gt 0 ] && B2=DiT-S/8 XL2=DiT-S/8  # the authors' registry has no DiT-T

log() { echo "$*" | tee -a "$OUT_DIR/summary.txt"; }

run_row() {  # run_row ROW COMMAND...: the row's own timeout, its log appended to logs.txt as it ends
  local row=$1 left=$(( END - $(date +%s) - 5 )) limit=$(( 2 * ESTIMATE[$1] )) t0 rc; shift
  if [ -n "$BUDGET" ] && (( ${ESTIMATE[$row]} > left )); then
    log "$row: skipped, estimated ${ESTIMATE[$row]} s and $left s of the budget left"
    SKIPPED+=("$row"); return
  fi
  (( limit > left )) && limit=$left
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$RES/$row.log" 2>&1
  rc=$?
  { echo "==== $row: $*"; cat "$RES/$row.log"; echo "rc $rc after $(( $(date +%s) - t0 )) s"; } |
    sed -E "s#$OUT_DIR#OUT_DIR#g; s#$RES#RES#g; s#/[^ :\"']*/site-packages/#site-packages/#g" >> "$OUT_DIR/logs.txt"  # no machine paths
  rm -f "$OUT_DIR/$row.md"  # the bench's tables are at the end of its log
  log "$row: rc $rc after $(( $(date +%s) - t0 )) s$( ((rc == 124 || rc == 137)) && echo ", cut off at $limit s")"
  ((rc == 0)) && PASSED+=("$row") || FAILED+=("$row")
}

bench() {  # bench ROW BENCH_ARGS...: lab.bench writing OUT_DIR/ROW.json after every variant and stage
  local row=$1; shift
  run_row "$row" $PY -m lab.bench --dtype bf16 "$@" --out "$OUT_DIR/$row.json"
}

training_row() {  # training_row ROW BACKBONE MICRO_BATCH [BENCH_ARGS...]: dit, tread and the paper code's,
  # compiled, one step of each of ours profiled
  bench "$1" --backbones "$2" --batch-sizes $BATCH --micro-batch "$3" "${STEPS[@]}" "${COMPILE[@]}" \
    "${PAPER[@]}" --profile --sections training "${@:4}"
}

xl2() { training_row xl2 $XL2 $MICRO --compile-scope blocks; }
xl2_ours() {  # xl2_ours ROW BENCH_ARGS...: xl2's sizes, compiled, ours alone, with the row's own options (scope too)
  bench "$1" --backbones $XL2 --batch-sizes $BATCH --micro-batch $MICRO "${STEPS[@]}" "${COMPILE[@]}" "${@:2}" \
    --sections training
}
xl2_blocks() { xl2_ours "$1" --compile-scope blocks --profile "${@:2}"; }  # compiled and profiled as xl2
xl2model() { xl2_ours xl2model --compile-scope model --profile; }
flux() { run_row flux $PY -m lab.bench_diffusers "${FLUX[@]}" --out "$OUT_DIR/flux.json"; }
b2() { training_row b2 $B2 $BATCH --compile-scope blocks; }
xl2bf16() { xl2_ours xl2bf16 --compile-scope model --fp32-after-route off; }
fid() { bench fid --backbones $B2 "${FID[@]}" --fid-compile "${COMPILE[@]}" --sections fid; }
suite() { bench suite "${SUITE[@]}" --sections suite --tmp-dir "$RES"; }
cuda() { run_row cuda $PY -m pytest -p no:cacheprovider -n 0 -m cuda "${PYTEST_CUDA[@]}"; }
train() {
  run_row train env TORCH_LOGS=recompiles,graph_breaks $PY train.py model=tread results_dir="$RES" \
    run_name=gpu_check train.mixed_precision=bf16 train.logging.tensorboard=false \
    train.eval.eval_interval=100 train.ckpt_every=100 train.logging.log_interval=50 "${TRAIN[@]}"
  cp "$RES/gpu_check/metrics.jsonl" "$OUT_DIR/train_metrics.jsonl" 2> /dev/null
}

cudnn() {  # its exit status: 0 no case faulted, 1 one did (both results), 2 it cannot run here (a dry run's CPU)
  run_row cudnn bash -c '"$0" -m lab.cudnn_attention_fault --out "$1"; rc=$?; (( rc <= 1 || ($2 && rc == 2) ))' \
    "$PY" "$OUT_DIR/cudnn.json" "$DRY"
}
xl2fp32math() { xl2_blocks xl2fp32math --attention-fp32 math; }
xl2static() { xl2_blocks xl2static --compile-dynamic false; }
xl2flash4() {
  if ! $PY -c "import flash_attn.cute" > /dev/null 2>&1; then
    log "xl2flash4: skipped, the flash-attn-4 package is not installed (pip install -e \".[hopper]\")"
    SKIPPED+=(xl2flash4); return
  fi
  xl2_blocks xl2flash4 --attention flash4
}

study256() {
  run_row study256 $PY -m lab.token_study --patch 1 --results "$RES/study256" --out "$OUT_DIR/study256.tar.gz" \
    "${STUDY[@]}"
}

# ---- the machine, the wheels, then the rows ------------------------------------------------------------------
: > "$OUT_DIR/summary.txt"
: > "$OUT_DIR/logs.txt"
log "gpu_check $( [ $DRY = 1 ] && echo '(dry run: CPU, toy sizes) ')$(date -u +%FT%TZ), budget ${BUDGET:-none} s:" \
  "${ROWS[*]}"
command -v nvidia-smi > /dev/null && log "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ $DRY = 0 ]; then
  if ls "${WHEELS:-.whl}"/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$RES/site" "${WHEELS:-.whl}"/*.whl \
      >> "$OUT_DIR/summary.txt" 2>&1 || log "wheel install failed"
    export PYTHONPATH=$RES/site:$PYTHONPATH
  else
    log "no wheels in ${WHEELS:-.whl}/ (copy ../shared/gpu-wheels/*.whl there and carry it)"
  fi
fi
[ ${#PAPER[@]} -gt 0 ] || log "no paper code in $PAPER_CODE/ (dit.py, routing_module.py of CompVis/tread): ours alone"
log "$($PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.cuda.is_available())" 2>&1)"
PASSED=() FAILED=() SKIPPED=()
for row in "${ROWS[@]}"; do
  $row
done
log "gpu_check summary: ${#PASSED[@]} passed (${PASSED[*]}), ${#FAILED[@]} failed (${FAILED[*]}), ${#SKIPPED[@]}" \
  "skipped (${SKIPPED[*]}) in $(( $(date +%s) - END + ${BUDGET:-3600} )) s"
