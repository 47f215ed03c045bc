#!/usr/bin/env bash
# The GPU check, in parts that each fit one device command (10 minutes at most) of one 30-minute loan,
# run in this order, each in the checkout's root:
#   bash scripts/gpu_check.sh part1 [OUT_DIR]   training steps, ours and the paper's code in the same call:
#       DiT-B/2 and DiT-XL/2 (XL/2 in two micro-batches of 128), dit and tread, batch 256, bf16, compiled,
#       the float32 block after the route on and off
#   bash scripts/gpu_check.sh part2 [OUT_DIR]   in-training FID-5K of DiT-B/2 stage by stage (compiled for one
#       batch shape), then the ADM suite on 50,000 samples against 10,000 references
#   bash scripts/gpu_check.sh part3 [OUT_DIR]   the CPU tests with CUDA hidden, beside two compiled training runs
#       of 200 steps with evaluations (recompiles and graph breaks logged); then `pytest -m cuda` alone on the GPU
#   bash scripts/gpu_check.sh part4 [OUT_DIR]   a run killed with kill -9 after a checkpoint and resumed against
#       an uninterrupted one; sample.py with CFG and with routing guidance; fid.py ref/calc; the ADM evaluator
#   bash scripts/gpu_check.sh --dry-run [partN ...] [OUT_DIR]   every part (or those named) on the CPU at toy size
# OUT_DIR: default $OUT (the folder a device command brings back), else gpu_check_out. Each part writes
# OUT_DIR/partN/: summary.txt (versions, the GPU, every stage's exit code and seconds) and one log per stage
# ending in "rc N after S s"; the benches rewrite their JSON after every variant and stage. Every stage has its
# own timeout (under 9 minutes) cut to what is left of the part's PART_BUDGET seconds (default 570), so a part
# ends inside its 10 minutes and a stage that fails or is cut off still leaves its log and partial JSON.
# At most 8 files per part, the most a device command brings back.
# Before a GPU part: the GPU image lacks hydra-core, omegaconf, antlr4, diffusers, webdataset and braceexpand;
# copy ../shared/gpu-wheels/*.whl into .whl/ (git-ignored) and carry it: each part installs them first. For the
# paper's code, put github.com/CompVis/tread's dit.py and routing_module.py in .paper-code/ (git-ignored, carried;
# PAPER_CODE names another folder); without them part1 times ours alone and says so in its summary.
set -u
usage() { echo "usage: bash scripts/gpu_check.sh [--dry-run] part1|part2|part3|part4 ... [OUT_DIR]" >&2; exit 2; }
PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)

# ---- internal steps, run as `bash gpu_check.sh __name ...` so that `timeout` can run them -------------------
if [ "${1:-}" = "__resume" ]; then  # __resume RESULTS_DIR STEPS TRAIN_OVERRIDES...: kill -9 after a checkpoint
  res=$2 steps=$3; shift 3
  half=$(printf "%08d" $(( steps / 2 ))) last=$(printf "%08d" "$steps")
  echo "== uninterrupted run"
  $PY train.py results_dir="$res" run_name=reference "$@" || exit 1
  echo "== run killed with kill -9 right after its step-$((steps / 2)) checkpoint"
  $PY train.py results_dir="$res" run_name=killed "$@" & pid=$!
  until [ -e "$res/killed/checkpoints/ckpt_$half.pt" ] || ! kill -0 $pid 2>/dev/null; do sleep 0.05; done
  kill -9 $pid; wait $pid; echo "killed: rc $?"
  echo "== resumed"
  $PY train.py results_dir="$res" run_name=killed "$@" || exit 1
  echo "== comparison"
  exec $PY - "$res/reference/checkpoints/ckpt_$last.pt" "$res/killed/checkpoints/ckpt_$last.pt" <<'EOF'
import sys, torch
a, b = (torch.load(f, weights_only=False) for f in sys.argv[1:3])
for part in ("model", "ema"):
    diffs = [(a[part][k].float() - b[part][k].float()).abs().max().item() for k in a[part]]
    print(f"{part}: {sum(d == 0 for d in diffs)}/{len(diffs)} tensors bit-identical, max |difference| {max(diffs):.3g}")
EOF
fi

DRY=0 DIR="" PARTS=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    part[1-4]) PARTS+=("$arg") ;;
    -h|--help|-*|part*) usage ;;
    *) [ -z "$DIR" ] || usage; DIR=$arg ;;
  esac
done
if [ ${#PARTS[@]} -eq 0 ]; then
  [ $DRY = 1 ] || { echo "name one part per device command (part1 .. part4)" >&2; usage; }
  PARTS=(part1 part2 part3 part4)
fi
ROOT=$(cd "$HERE/.." && pwd)
cd "$ROOT" || exit 1
OUT_DIR=$(mkdir -p "${DIR:-${OUT:-gpu_check_out}}" && cd "${DIR:-${OUT:-gpu_check_out}}" && pwd) || exit 1
export PYTHONUNBUFFERED=1
PAPER_CODE=${PAPER_CODE:-.paper-code}
RES=$(mktemp -d)

# ---- sizes: the GPU check, or toy sizes on the CPU -----------------------------------------------------------
if [ $DRY = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  B2=DiT-T/8 XL2=DiT-T/8 BATCH=4 XL2_MICRO=(--micro-batch 2) STEPS=(--steps 1 --warmup 1)
  COMPILE=(--compile on --compile-backend eager --device cpu)  # dynamo traces, graphs counted; no inductor build
  FID=(--backbones DiT-T/8 --fid-samples 3 --fid-steps 2 --fid-batch 2 --vae "${BENCH_VAE:-random}" --device cpu)
  SUITE=(--suite-samples 8 --suite-ref 4 --suite-batch 4 --device cpu)
  PYTEST_CPU=(--collect-only -m "not cuda") PYTEST_CUDA=(--collect-only -n 0 -m cuda)
  TRAIN=("+model.params.depth=4" "+model.params.hidden_size=32" "+model.params.num_heads=2"
         train.general.batch_size=16 train.general.num_workers=0 train.logging.tensorboard=false
         train.eval.fid_num_samples=128 train.eval.batch_size=64 train.eval.sampler.num_steps=2)
  ROUTE=(model.params.routes.0.start_layer_idx=1 model.params.routes.0.end_layer_idx=2)
  TRAIN_STEPS=4 TRAIN_COMPILE=false SAMPLES=8 DEVICE=cpu
else
  B2=DiT-B/2 XL2=DiT-XL/2 BATCH=256 XL2_MICRO=() STEPS=(--steps 5 --warmup 2)
  COMPILE=(--compile on)
  FID=(--backbones DiT-B/2 --fid-samples 5000 --fid-steps 40 --fid-batch 256)
  SUITE=(--suite-samples 50000 --suite-ref 10000 --suite-batch 250)
  PYTEST_CPU=(-n 8 -m "not cuda") PYTEST_CUDA=(-n 0 -m cuda)  # -n 0: the CUDA tests one at a time on the one GPU
  TRAIN=() ROUTE=() TRAIN_STEPS=200 TRAIN_COMPILE=true SAMPLES=512 DEVICE=cuda
fi
TRAIN+=(train.max_steps=$TRAIN_STEPS train.ckpt_every=$((TRAIN_STEPS / 2)) train.eval.eval_interval=$((TRAIN_STEPS / 2))
        train.logging.log_interval=$((TRAIN_STEPS / 4)))

stage() {  # stage NAME LIMIT_S COMMAND...: its own timeout, cut to what is left of the part's budget
  local name=$1 limit=$2 t0 rc; shift 2
  local left=$(( PART_END - $(date +%s) - 5 ))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    echo "skipped: the part's time budget is spent" > "$DEST/$name.log"
    echo "$name: skipped, the part's time budget is spent" >> "$DEST/summary.txt"
    return 0
  fi
  echo "$name: started $(date -u +%H:%M:%S), limit $limit s" >> "$DEST/summary.txt"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$DEST/$name.log" 2>&1
  rc=$?
  echo "rc $rc after $(( $(date +%s) - t0 )) s" >> "$DEST/$name.log"
  echo "$name: rc $rc after $(( $(date +%s) - t0 )) s$( ((rc == 124 || rc == 137)) && echo ' (timed out)')" \
    >> "$DEST/summary.txt"
}

setup() {  # the part's folder, summary header, and (on the GPU) the missing wheels
  DEST="$OUT_DIR/$1"
  mkdir -p "$DEST"
  PART_END=$(( $(date +%s) + ${PART_BUDGET:-570} ))
  { echo "$1 $( [ $DRY = 1 ] && echo '(dry run: CPU, toy sizes)') $(date -u +%FT%TZ)"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  } > "$DEST/summary.txt"
  if [ $DRY = 0 ]; then
    if ls "${WHEELS:-.whl}"/*.whl > /dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl \
        >> "$DEST/summary.txt" 2>&1 || echo "wheel install failed" >> "$DEST/summary.txt"
      export PYTHONPATH=/tmp/site:$ROOT
    else
      echo "no wheels in ${WHEELS:-.whl}/ (copy ../shared/gpu-wheels/*.whl there and carry it)" >> "$DEST/summary.txt"
      export PYTHONPATH=$ROOT
    fi
  fi
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.cuda.is_available())" >> "$DEST/summary.txt" 2>&1
}

bench() {  # bench NAME LIMIT_S BENCH_ARGS...: lab.bench writing DEST/NAME.json (and .md)
  local name=$1 limit=$2; shift 2
  stage "$name" "$limit" $PY -m lab.bench --dtype bf16 "$@" --out "$DEST/$name.json"
}

part1() {
  local paper=()
  if [ -f "$PAPER_CODE/dit.py" ]; then
    paper=(--paper-code "$PAPER_CODE" --paper-modes published)
  else
    echo "no paper code in $PAPER_CODE/ (dit.py, routing_module.py of github.com/CompVis/tread): ours alone" \
      >> "$DEST/summary.txt"
  fi
  local common=(--batch-sizes $BATCH "${STEPS[@]}" "${COMPILE[@]}" --fp32-after-route both "${paper[@]}"
                --sections training)
  bench bench_b2 240 --backbones $B2 "${common[@]}"
  bench bench_xl2 530 --backbones $XL2 "${XL2_MICRO[@]}" "${common[@]}"
}

part2() {
  bench bench_fid 270 "${FID[@]}" --fid-compile "${COMPILE[@]}" --sections fid
  bench bench_suite 530 "${SUITE[@]}" --sections suite --tmp-dir "$RES"
}

train() {  # train NAME OVERRIDES...: 200 compiled bf16 steps (toy: 4 eager) with two evaluations, dynamo logging on
  local name=$1; shift
  stage "train_$name" 240 env TORCH_LOGS=recompiles,graph_breaks $PY train.py results_dir="$RES" run_name="$name" \
    train.mixed_precision=bf16 train.compile=$TRAIN_COMPILE "${TRAIN[@]}" "$@"
}

part3() {
  # the CPU tests see no GPU, so they may share the machine with the training runs (nothing is timed here);
  # `pytest -m cuda` runs after them, alone on the GPU
  stage pytest_cpu 530 env CUDA_VISIBLE_DEVICES="" $PY -m pytest -q -p no:cacheprovider "${PYTEST_CPU[@]}" &
  local cpu=$!
  train tread model=tread "${ROUTE[@]}" &
  train dit model=dit &
  wait $(jobs -p | grep -vx "$cpu")
  for f in "$DEST"/train_*.log; do
    echo "$(basename "$f" .log): $(grep -c 'Recompiling function' "$f") recompile(s), $(grep -c 'Graph break' "$f") graph" \
      "break line(s), $(tail -n 1 "$f")"
  done >> "$DEST/summary.txt"
  stage pytest_cuda 300 $PY -m pytest -q -p no:cacheprovider "${PYTEST_CUDA[@]}"
  wait $cpu
}

part4() {
  stage resume 240 bash "$HERE/gpu_check.sh" __resume "$RES" $TRAIN_STEPS model=tread train.mixed_precision=bf16 \
    "${TRAIN[@]}" "${ROUTE[@]}"
  local ckpt="$RES/reference"
  stage sample_cfg 120 $PY sample.py ckpt="$ckpt" num_samples=$SAMPLES out="$RES/cfg.npz" cfg_scale=1.5 \
    guidance_interval=[0.3,5] grid="$DEST/sample_cfg.png" progress=false
  stage sample_routing_guidance 120 $PY sample.py ckpt="$ckpt" num_samples=$SAMPLES out="$RES/rg.npz" \
    routing_guidance.scale=1.5 progress=false
  stage fid_ref 60 $PY fid.py ref --images "$RES/cfg.npz" --out "$RES/ref.npz" --network digits --device $DEVICE
  stage fid_calc 60 $PY fid.py calc --images "$RES/rg.npz" --ref "$RES/ref.npz" --network digits --device $DEVICE
  stage evaluator 240 $PY -m evaluations.evaluator "$RES/cfg.npz" "$RES/rg.npz" --random-init --device $DEVICE \
    --no-progress
}

for part in "${PARTS[@]}"; do
  setup "$part"
  $part
  cat "$DEST/summary.txt"
done
rm -rf "$RES"
