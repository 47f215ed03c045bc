#!/usr/bin/env bash
# The pipeline on one CUDA GPU, end to end, with raw logs (issue 13, section 1):
#   bash scripts/gpu_check.sh OUT_DIR
# 1. the test suite (CUDA-marked tests included), 2. bf16/fp16 x compiled/eager training of dit and
# tread on the digits with in-training FID (recompiles counted from TORCH_LOGS=recompiles), 3. a run
# killed with kill -9 right after a checkpoint and resumed, against an uninterrupted one, 4. sample.py
# with CFG and routing guidance, 5. fid.py and evaluations/evaluator.py on the GPU.
# Every step writes OUT_DIR/<step>.txt ending in "rc N"; the script goes on past a failure.
set -u
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
RES=$(mktemp -d)
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  ( timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc $?" >> "$OUT/$name.txt" )
}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" > "$OUT/versions.txt" 2>&1

step pytest 420 $PY -m pytest -q -p no:cacheprovider -n 8 -ra &
TESTS=$!

train() {  # train NAME OVERRIDES...
  local name=$1; shift
  step "train_$name" 300 env TORCH_LOGS=recompiles $PY train.py results_dir="$RES" run_name="$name" \
    train.max_steps=200 train.ckpt_every=100 train.eval.eval_interval=100 train.logging.log_interval=50 "$@"
}
for model in dit tread; do
  for precision in bf16 fp16; do
    for compile in false true; do
      train "${model}_${precision}_compile_${compile}" model=$model train.mixed_precision=$precision \
        train.compile=$compile &
    done
  done
done
wait $(jobs -p | grep -vx "$TESTS")
for f in "$OUT"/train_*.txt; do
  echo "$(basename "$f" .txt): $(grep -c 'Recompiling function' "$f") recompiles, $(tail -n 1 "$f")"
done > "$OUT/recompiles.txt"

# kill -9 right after the step-100 checkpoint (its evaluation at the same step not yet done), then resume
KR=(model=tread train.mixed_precision=bf16 train.max_steps=200 train.ckpt_every=100 train.eval.eval_interval=100)
step resume_reference 300 $PY train.py results_dir="$RES" run_name=reference "${KR[@]}"
( $PY train.py results_dir="$RES" run_name=killed "${KR[@]}" > "$OUT/resume_killed.txt" 2>&1 & pid=$!
  until [ -e "$RES/killed/checkpoints/ckpt_00000100.pt" ] || ! kill -0 $pid 2>/dev/null; do sleep 0.05; done
  kill -9 $pid; wait $pid; echo "rc $? (killed after its step-100 checkpoint)" >> "$OUT/resume_killed.txt" )
step resume_restarted 300 $PY train.py results_dir="$RES" run_name=killed "${KR[@]}"
step resume_compare 120 $PY - "$RES" <<'EOF'
import sys, torch
root = sys.argv[1]
a = torch.load(f"{root}/reference/checkpoints/ckpt_00000200.pt", weights_only=False)
b = torch.load(f"{root}/killed/checkpoints/ckpt_00000200.pt", weights_only=False)
for part in ("model", "ema"):
    diffs = [(k, (a[part][k].float() - b[part][k].float()).abs().max().item()) for k in a[part]]
    equal = sum(d == 0 for _, d in diffs)
    print(f"{part}: {equal}/{len(diffs)} tensors bit-identical, max |difference| {max(d for _, d in diffs):.3g}")
EOF

CKPT="$RES/tread_bf16_compile_false"
step sample_cfg 300 $PY sample.py ckpt="$CKPT" num_samples=512 out="$RES/cfg.npz" cfg_scale=1.5 \
  guidance_interval=[0.3,5] grid="$OUT/sample_cfg.png" progress=false
step sample_routing_guidance 300 $PY sample.py ckpt="$CKPT" num_samples=512 out="$RES/rg.npz" \
  routing_guidance.scale=1.5 progress=false
step fid_ref 300 $PY fid.py ref --images "$RES/cfg.npz" --out "$RES/ref.npz" --network digits --device cuda
step fid_calc 300 $PY fid.py calc --images "$RES/rg.npz" --ref "$RES/ref.npz" --network digits --device cuda
step evaluator 300 $PY evaluations/evaluator.py "$RES/cfg.npz" "$RES/rg.npz" --random-init --device cuda --no-progress
wait $TESTS
grep -h "^rc " "$OUT"/*.txt | sort | uniq -c > "$OUT/exit_codes.txt"
