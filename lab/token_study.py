"""`dit` against `tread` on the embedded digits at a chosen token count, every run side by side, archived as the
toy study's runs are (docs/results.md, "By token count"):

    python -m lab.token_study --patch 1 --out study256.tar.gz            # 256 tokens: the GPU check's study256
    tar -xzf study256.tar.gz -C docs/results/tokens256                   # runs/<run>/{config.yaml, metrics.jsonl, ...}

The model is the preset's DiT-D (12 blocks, 64 wide) at another patch size: 16 x 16 digits at patch 1 give 256
tokens, so the only change from the 16-token (patch 4) and 64-token (patch 2) studies is the token count; the
route is the preset's, 2 -> 8 at 0.5. Each run evaluates FID, class_acc and nn_ratio every 250 steps on 512
samples, as the toy study's do. The runs start together (a small model leaves a GPU mostly idle between its
kernels) and the archive is one file, since a device command brings back few files.

Sizing for scripts/gpu_check.sh (300 s on an H200): its `train` row (docs/perf/h200_check/train_metrics.jsonl)
trains the digits preset compiled at 51-59 steps/s with an evaluation of 256 samples in 1.2 s; at 256 tokens and
512 samples take 50 steps/s and 3 s, so a 3,000-step run is 60 s of steps, 36 s of evaluations and about 30 s of
start-up and compiling: about 130 s alone, and the six at once on one GPU share it, which the row's estimate of
240 s allows for.
"""
import argparse
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_names(models, seeds) -> list:
    return [(model, seed, f"global_seed={seed},model={model}") for model in models for seed in seeds]


def archive(results: Path, names, out: Path) -> None:
    """Each run's config.yaml (results_dir made relative to the archive), status.json, metrics.jsonl and newest
    sample grid, as runs/<run>/ in one tar.gz."""
    with tarfile.open(out, "w:gz") as tar:
        for name in names:
            run = results / name
            for kept in ("config.yaml", "status.json", "metrics.jsonl"):
                if (run / kept).is_file():
                    text = (run / kept).read_text()
                    if kept == "config.yaml":
                        text = text.replace(f"results_dir: {results}", f"results_dir: results/{results.name}")
                    add_text(tar, f"runs/{name}/{kept}", text)
            grids = sorted((run / "samples").glob("step_*.png")) if (run / "samples").is_dir() else []
            if grids:
                tar.add(grids[-1], arcname=f"runs/{name}/samples/{grids[-1].name}")


def add_text(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def final_scores(results: Path, names) -> dict:
    """The last evaluation of each run (step, fid, class_acc), or None where it logged none."""
    scores = {}
    for name in names:
        path = results / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        evals = [r for r in rows if "fid" in r]
        scores[name] = {k: evals[-1][k] for k in ("step", "fid", "class_acc")} if evals else None
    return scores


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.token_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--patch", type=int, default=1, help="patch size: 1 (256 tokens), 2 (64), 4 (16, the preset's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--results", type=Path, required=True, help="the runs' folder (results_dir)")
    p.add_argument("--out", type=Path, required=True, help="the archive, a .tar.gz")
    p.add_argument("overrides", nargs="*", help="more train.py overrides for every run (e.g. the dry run's sizes)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    names = run_names(("dit", "tread"), args.seeds)
    base = [sys.executable, str(REPO / "train.py"), f"results_dir={args.results}", "model.backbone_type=DiT-D/4",
            f"model.params.patch_size={args.patch}", f"train.max_steps={args.steps}", "train.eval.eval_interval=250",
            "train.eval.fid_num_samples=512", "train.ckpt_every=250", "train.logging.tensorboard=false"]
    procs = [subprocess.Popen([*base, f"model={model}", f"global_seed={seed}", f"run_name='{name}'", *args.overrides],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for model, seed, name in names]
    failed = []
    for (model, seed, name), proc in zip(names, procs):
        output, _ = proc.communicate()
        print(f"==== {name}: exit {proc.returncode}\n{output[-3000:]}", flush=True)
        if proc.returncode:
            failed.append(name)
    archive(args.results, [n for _, _, n in names], args.out)
    for name, score in final_scores(args.results, [n for _, _, n in names]).items():
        print(f"{name}: {score}")
    print(f"archived {len(names)} runs in {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
