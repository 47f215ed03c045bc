#!/usr/bin/env bash
# Toy-scale reproduction on the embedded digits (the preset's model: DiT-D/4, 12 blocks, 64 wide, 16 tokens):
#   1. DiT against TREAD (its default route), seeds 0, 1, 2 (the paper's Table 2)        -> $RESULTS/compare/
#   2. selection-ratio ablation 0 / 0.25 / 0.5 / 0.75, seed 0 (the paper's Table 5)       -> $RESULTS/ratio/
#   3. report.py over both                                                                -> $REPORT/
# Every run trains STEPS steps and evaluates FID every EVAL_EVERY steps on EVAL_SAMPLES samples.
#
# Resumable: run it again and completed runs print "already complete" and exit at once, interrupted
# runs continue from their newest checkpoint, failed runs are tried again. A different STEPS resumes
# the same run dirs (train.max_steps is not part of a run dir's name) and trains on to the new budget.
#
#   scripts/reproduce_digits.sh                       # defaults below
#   STEPS=4000 scripts/reproduce_digits.sh            # longer (see docs/sweeps.md on memorisation)
#   scripts/reproduce_digits.sh train.mixed_precision=bf16   # extra overrides go to every train.py run
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-600}               # step budget of every run
EVAL_EVERY=${EVAL_EVERY:-150}     # in-training FID every this many steps
EVAL_SAMPLES=${EVAL_SAMPLES:-256} # samples per FID evaluation
RESULTS=${RESULTS:-results/repro}
REPORT=${REPORT:-$RESULTS/report}
PYTHON=${PYTHON:-python}

budget=("results_dir=$RESULTS" "train.max_steps=$STEPS" "train.eval.eval_interval=$EVAL_EVERY"
        "train.eval.fid_num_samples=$EVAL_SAMPLES")

# 1. dit vs tread, 3 seeds each: 6 runs, sequential (same run dirs as `+sweep=compare`)
"$PYTHON" train.py -m run_name=compare model=dit,tread global_seed=0,1,2 "${budget[@]}" "$@"

# 2. ratio ablation on tread's default route, global_seed 0: ratios 0.25 and 0.75 here; ratio 0 is the
#    `dit` seed-0 run and ratio 0.5 the `tread` seed-0 run of step 1 (same code path, seed and random
#    stream: a ratio-0 route draws nothing), so they are not trained twice. RATIOS=0,0.25,0.5,0.75 runs all.
RATIOS=${RATIOS:-0.25,0.75}
"$PYTHON" train.py -m run_name=ratio model.params.routes.0.selection_ratio=$RATIOS "${budget[@]}" "$@"

# 3. table + plots: $REPORT/report.md, report.csv, fid_vs_step, fid_vs_time, route_placement (.png, .svg)
"$PYTHON" -m tools.report "$RESULTS/compare" "$RESULTS/ratio" --out "$REPORT"
