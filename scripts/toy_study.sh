#!/usr/bin/env bash
# The toy study on the embedded digits (the preset's DiT-D/4: 12 blocks, 16 tokens), in stages:
#   compare    dit against tread (its default route), seeds 0, 1, 2, STEPS steps     -> $RESULTS/compare/
#   placement  tread routes start {0,2,4} x end {5,8,10} at 0.5, seed 0, PLACEMENT_STEPS -> $RESULTS/placement/
#   ratio      tread's route at RATIOS (0.25, 0.75), seeds 0, 1, 2, RATIO_STEPS       -> $RESULTS/ratio/
#              (ratios 0 and 0.5 are compare's dit and tread runs, which the report reads up to RATIO_STEPS: a
#              ratio-0 route is the dit computation, and the same seed and settings train the same run)
#   platform   the successors against compare's dit and tread, seeds 0, 1, 2, STEPS    -> $RESULTS/platform/
#              PLATFORM picks the variants (default all): sprint (route 2 -> 9 at 0.75, fusion sprint: 2 dense
#              blocks on each side, as theirs), repa (tread + REPA, block 3, the digits classifier's map),
#              tread_off (tread with routing off for the last 20% of the steps), sprint_off (sprint with no token
#              dropped for the last 20%, fusion and path drop kept: SPRINT's full-token fine-tune in the same run)
#   precision  tread under train.mixed_precision=bf16, the block after the route in float32 (the authors',
#              model.params.fp32_after_route=true) and in bf16 (false), seeds 0, 1, 2, STEPS   -> $RESULTS/precision/
#   cost       the step cost alone: dit, tread at 0.25 / 0.5 / 0.75, SPRINT and tread + REPA (COST, COST_RATIOS
#              choose), one run at a time
#              (whatever JOBS is; each on the threads a study run gets), COST_STEPS steps, no evaluation -> $RESULTS/cost/
#   guidance   lab/guidance_eval.py on the SPRINT seed-0 run: unguided, CFG and path-drop guidance at
#              GUIDANCE_SCALES, equal network evaluations, EVAL_SAMPLES samples    -> $REPORT/guidance/
#              (GUIDANCE_RUN=sprint_off: the platform's sprint_off seed-0 run -> $REPORT/guidance_sprint_off/)
#   archive    each run's config.yaml (results_dir relative to the checkout), status.json, metrics.jsonl and
#              newest sample grid -> $ARCHIVE/<part>/<run>/
#              (kilobytes a run, no checkpoints: commit it, and the report rebuilds from it with RESULTS=$ARCHIVE
#              after the run folders are gone; rerun it as runs finish, it replaces what it copied before)
#   report     lab/study_report.py over the training parts run so far                 -> $REPORT/
#              (UNTIMED: folder-name patterns of runs to compare per step only, e.g. runs trained on another machine)
#              and lab/digits_reference_limit.py: real digits scored as EVAL_SAMPLES samples are -> $REPORT/reference_limit/
# Every run evaluates FID, class_acc and nn_ratio every EVAL_EVERY steps on EVAL_SAMPLES samples and
# keeps a checkpoint at each evaluation, so an interrupted run loses at most EVAL_EVERY steps.
#
# Resumable: run it again and completed runs exit at once ("already complete"), interrupted runs go on
# from their newest checkpoint, failed runs are tried again. train.max_steps, the eval settings and
# train.ckpt_every are not part of a run dir's name, so a larger budget trains the same runs further.
#
#   scripts/toy_study.sh                                  # every stage, defaults below
#   STAGES=compare scripts/toy_study.sh                   # find the window before copying first
#   STAGES=placement,ratio,report PLACEMENT_STEPS=1000 RATIO_STEPS=1000 scripts/toy_study.sh  # shorter
#   scripts/toy_study.sh train.mixed_precision=bf16       # extra overrides go to every train.py run
#   JOBS=2 scripts/toy_study.sh                           # 2 runs at a time, each on nproc / JOBS threads
#
# JOBS > 1 launches each job of a stage's sweep as its own one-job multirun (the same run dir as in the
# whole sweep), spread round-robin over JOBS workers, each with train.cpu_threads = nproc / JOBS (not part of
# the run dir's name; a later override on the command line wins), and skips a job whose run ARCHIVE already
# holds completed (a run of an earlier session, whose run folder is gone).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGES=${STAGES:-compare,placement,ratio,platform,precision,cost,guidance,archive,report}
STEPS=${STEPS:-3000}                      # compare's budget: 3,000 steps
PLACEMENT_STEPS=${PLACEMENT_STEPS:-2000}  # where compare separates best (class_acc Welch p 0.008 at 2,000; docs/results.md)
RATIO_STEPS=${RATIO_STEPS:-2000}
RATIOS=${RATIOS:-0.25,0.75}               # RATIOS=0,0.25,0.5,0.75 trains all four without compare
PLATFORM=${PLATFORM:-sprint,repa,tread_off,sprint_off}
GUIDANCE_RUN=${GUIDANCE_RUN:-sprint}      # the platform variant whose seed-0 checkpoint the guidance stage scores
COST_STEPS=${COST_STEPS:-400}
COST=${COST:-dit,tread,sprint,repa}       # the cost stage's runs; tread's at each of COST_RATIOS
COST_RATIOS=${COST_RATIOS:-0.25,0.5,0.75}
GUIDANCE_SCALES=${GUIDANCE_SCALES:-1.5 2 3}
EVAL_EVERY=${EVAL_EVERY:-250}             # FID + class_acc + nn_ratio every this many steps
EVAL_SAMPLES=${EVAL_SAMPLES:-512}
RESULTS=${RESULTS:-results/study}
REPORT=${REPORT:-docs/results}
ARCHIVE=${ARCHIVE:-docs/results/runs}
PYTHON=${PYTHON:-python}
UNTIMED=${UNTIMED:-}                      # space-separated patterns, each one --untimed of lab/study_report.py
JOBS=${JOBS:-1}
EXTRA=("$@")
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "error: JOBS=$JOBS is not a positive integer (e.g. JOBS=2)" >&2; exit 2; }
if (( JOBS > 1 )); then  # train.py sets its own threads (train.cpu_threads, auto = all cores): share them
  threads=$(( $(nproc) / JOBS ))
  EXTRA=("train.cpu_threads=$(( threads > 0 ? threads : 1 ))" "${EXTRA[@]}")
fi

for stage in ${STAGES//,/ }; do
  case "$stage" in compare|placement|ratio|platform|precision|cost|guidance|archive|report) ;; *) echo "error: unknown" \
    "stage '$stage' in STAGES=$STAGES (compare, placement, ratio, platform, precision, cost, guidance, archive, report)" >&2
    exit 2;; esac
done
route=model.params.routes.0
sprint="$route.end_layer_idx=9 $route.fusion=sprint $route.selection_ratio=0.75"
off="train.routing_off_after=$(( STEPS * 4 / 5 ))"
declare -A VARIANT=([sprint]="$sprint" [repa]="repa.enabled=true" [tread_off]="$off" [sprint_off]="$sprint $off")
for variant in ${PLATFORM//,/ }; do
  [[ -n "${VARIANT[$variant]+set}" ]] || { echo "error: unknown variant '$variant' in PLATFORM=$PLATFORM" \
    "(sprint, repa, tread_off, sprint_off)" >&2; exit 2; }
done
declare -A COST_JOB=([dit]="model=dit" [tread]="model=tread $route.selection_ratio=$COST_RATIOS"
                     [sprint]="model=tread $sprint" [repa]="model=tread repa.enabled=true")
for name in ${COST//,/ }; do
  [[ -n "${COST_JOB[$name]+set}" ]] || { echo "error: unknown cost run '$name' in COST=$COST" \
    "(dit, tread, sprint, repa)" >&2; exit 2; }
done
[[ "${VARIANT[$GUIDANCE_RUN]:-}" == *fusion=sprint* ]] || { echo "error: GUIDANCE_RUN=$GUIDANCE_RUN is not a" \
  "variant with path-drop guidance (sprint, sprint_off)" >&2; exit 2; }
wanted() { [[ ",$STAGES," == *",$1,"* ]]; }
train() {  # train <steps> <run_name> <sweep overrides...> [extra overrides from the command line]
  local steps=$1 name=$2
  shift 2
  "$PYTHON" train.py -m "run_name=$name" "results_dir=$RESULTS" "train.max_steps=$steps" \
    "train.eval.eval_interval=$EVAL_EVERY" "train.eval.fid_num_samples=$EVAL_SAMPLES" "train.ckpt_every=$EVAL_EVERY" "$@"
}
expand() {  # expand <override>...: one line per job of the Hydra sweep they make (values split at commas)
  local lines=("") next o v line vals
  for o in "$@"; do
    next=()
    IFS=, read -ra vals <<< "${o#*=}"
    for line in "${lines[@]}"; do for v in "${vals[@]}"; do next+=("${line:+$line }${o%%=*}=$v"); done; done
    lines=("${next[@]}")
  done
  printf '%s\n' "${lines[@]}"
}
# The overrides a multirun job's directory name leaves out (configs/config.yaml, hydra's override_dirname).
EXCLUDED=" $(sed -n '/exclude_keys: \[/,/\]/p' configs/config.yaml | tr -d '[]\n' | sed 's/exclude_keys://; s/,/ /g') "
archived() {  # archived <part> <steps> <overrides...>: the archive holds the run these overrides make, completed at
              # <steps> or later (runs of an earlier session: a study can be trained over several)
  local part=$1 steps=$2 o kept=() dir last
  shift 2
  for o in "$@"; do [[ "$EXCLUDED" == *" ${o%%=*} "* ]] || kept+=("$o"); done
  dir="$ARCHIVE/$part/$(printf '%s\n' "${kept[@]}" | LC_ALL=C sort | paste -sd, - | tr / _)"
  grep -q '"completed"' "$dir/status.json" 2> /dev/null || return 1
  last=$(grep -o '"step": [0-9]*' "$dir/metrics.jsonl" | tail -n 1 | grep -o '[0-9]*$')
  (( ${last:-0} >= steps ))
}
sweep() {  # sweep <steps> <run_name> <group>...: each group a string of overrides making one Hydra sweep; JOBS=1
           # runs each group as one multirun, JOBS > 1 spreads the jobs of all groups over JOBS parallel workers
  local steps=$1 name=$2 w pids=() rc=0 jobs=() group line
  shift 2
  if (( JOBS == 1 )); then
    # shellcheck disable=SC2086  # a group is split into its overrides on purpose
    for group in "$@"; do train "$steps" "$name" $group "${EXTRA[@]}" || rc=1; done
    return "$rc"
  fi
  for group in "$@"; do
    # shellcheck disable=SC2086
    while IFS= read -r line; do jobs+=("$line"); done < <(expand $group)
  done
  for ((w = 0; w < JOBS; w++)); do
    (
      failed=0
      for ((i = w; i < ${#jobs[@]}; i += JOBS)); do
        # shellcheck disable=SC2086  # a job line is split into its overrides on purpose
        if archived "$name" "$steps" ${jobs[i]} "${EXTRA[@]}"; then
          echo "archived in $ARCHIVE/$name, complete: ${jobs[i]}"
          continue
        fi
        # shellcheck disable=SC2086
        train "$steps" "$name" ${jobs[i]} "${EXTRA[@]}" || failed=1
      done
      exit "$failed"
    ) &
    pids+=("$!")
  done
  for w in "${pids[@]}"; do wait "$w" || rc=1; done
  return "$rc"
}
if wanted compare; then
  sweep "$STEPS" compare "model=dit,tread global_seed=0,1,2"
fi
if wanted placement; then
  sweep "$PLACEMENT_STEPS" placement "model=tread global_seed=0 $route.start_layer_idx=0,2,4 \
    $route.end_layer_idx=5,8,10 $route.selection_ratio=0.5"
fi
if wanted ratio; then
  sweep "$RATIO_STEPS" ratio "model=tread global_seed=0,1,2 $route.selection_ratio=$RATIOS"
fi
if wanted platform; then
  groups=()
  for variant in ${PLATFORM//,/ }; do groups+=("model=tread global_seed=0,1,2 ${VARIANT[$variant]}"); done
  sweep "$STEPS" platform "${groups[@]}"
fi
if wanted precision; then  # the authors' float32 block after the route against a bf16 one, both under bf16
  sweep "$STEPS" precision "model=tread global_seed=0,1,2 train.mixed_precision=bf16 model.params.fp32_after_route=true,false"
fi
if wanted cost; then  # runs sharing the cores slow each other unevenly: here each has the machine to itself
  for name in ${COST//,/ }; do
    job=${COST_JOB[$name]}
    # shellcheck disable=SC2086  # a job is split into its overrides on purpose
    train "$COST_STEPS" cost global_seed=0 $job train.eval.eval_interval=0 "train.ckpt_every=$COST_STEPS" "${EXTRA[@]}"
  done
fi
if wanted guidance; then  # the seed-0 run's directory: its overrides, sorted (Hydra's override_dirname)
  out="$REPORT/guidance"
  [[ "$GUIDANCE_RUN" == sprint ]] || out+="_$GUIDANCE_RUN"
  # shellcheck disable=SC2086  # the variant is split into its overrides on purpose
  run=$(printf '%s\n' global_seed=0 model=tread ${VARIANT[$GUIDANCE_RUN]} | LC_ALL=C sort | paste -sd, -)
  # shellcheck disable=SC2086  # the scales are separate arguments
  "$PYTHON" -m lab.guidance_eval "$RESULTS/platform/$run" --cfg-scales $GUIDANCE_SCALES \
    --pdg-scales $GUIDANCE_SCALES --num-samples "$EVAL_SAMPLES" --out "$out"
fi
if wanted archive; then
  for part in compare placement ratio platform precision cost; do
    [[ -d "$RESULTS/$part" ]] || continue
    while IFS= read -r -d '' status; do
      run=$(dirname "$status")
      dest="$ARCHIVE/$part/${run#"$RESULTS/$part/"}"
      mkdir -p "$dest"
      rm -rf "$dest/samples"
      for f in status.json metrics.jsonl; do [[ -f "$run/$f" ]] && cp "$run/$f" "$dest/"; done
      if [[ -f "$run/config.yaml" ]]; then  # a results_dir inside this checkout is kept relative to it
        while IFS= read -r line || [[ -n "$line" ]]; do
          [[ "$line" == "results_dir: $PWD/"* ]] && line="results_dir: ${line#"results_dir: $PWD/"}"
          printf '%s\n' "$line"
        done < "$run/config.yaml" > "$dest/config.yaml"
      fi
      [[ -d "$run/samples" ]] || continue  # the cost runs do not evaluate
      grid=$(find "$run/samples" -maxdepth 1 -name 'step_*.png' | LC_ALL=C sort | tail -n 1)
      if [[ -n "$grid" ]]; then mkdir -p "$dest/samples" && cp "$grid" "$dest/samples/"; fi
    done < <(find "$RESULTS/$part" -name status.json -not -path '*.replaced-*' -print0)
  done
  echo "archived the runs under $RESULTS -> $ARCHIVE"
fi
if wanted report; then
  roots=()  # the parts run so far (study.md names its sources); none at all is the report's error
  for part in compare placement ratio platform precision cost; do [[ -d "$RESULTS/$part" ]] && roots+=("$RESULTS/$part"); done
  (( ${#roots[@]} )) || { echo "error: no study runs under $RESULTS (run a training stage first)" >&2; exit 2; }
  untimed=() patterns=()
  read -ra patterns <<< "$UNTIMED"  # split at spaces, never globbed here
  for pattern in "${patterns[@]}"; do untimed+=(--untimed "$pattern"); done
  "$PYTHON" -m lab.study_report "${roots[@]}" --out "$REPORT" "${untimed[@]}"
  "$PYTHON" -m lab.digits_reference_limit --num-samples "$EVAL_SAMPLES" --out "$REPORT/reference_limit"
fi
