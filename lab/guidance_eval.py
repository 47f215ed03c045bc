"""Guidance at equal network evaluations on one checkpoint: unguided, classifier-free guidance and SPRINT's
path-drop guidance, scored as in-training evaluation scores (the same sampler, seeds and metrics).

    python -m lab.guidance_eval results/platform/RUN --cfg-scales 1.5 2 --pdg-scales 1.5 2 --out docs/results/guidance

Both guidances make two network passes per sampler evaluation (CFG: conditional and unconditional; PDG: the
full model and the model without its deep paths), so at one sampler setting they spend the same number of
network evaluations (NFE); the FLOPs differ, since PDG's weak pass skips the deep blocks. The table gives FID,
class_acc and nn_ratio (digits runs) per setting, the NFE, the sampling seconds measured here and the FLOPs per
sample (training/flops.py, counted on the meta device). Writes guidance.md and guidance.json, and the grids.
"""
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from generation import count_network_evaluations
from training.checkpoint import load_sampling_net, resolve_checkpoint
from training.flops import guidance_flops, sampling_forward_flops
from training.in_training_eval import TrainingEvaluator
from tread_utils.errors import UserError, exit_with
from tread_utils.cli import ArgumentParser, positive_int

METRICS = ("fid", "class_acc", "nn_ratio")


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{text!r} is not a number >= 0")
    return value


def build_parser():
    p = ArgumentParser(prog="python -m lab.guidance_eval", description=__doc__.split("\n")[0])
    p.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint file")
    p.add_argument("--cfg-scales", type=nonnegative_float, nargs="*", default=[1.5],
                   help="classifier-free guidance scales (default 1.5)")
    p.add_argument("--pdg-scales", type=nonnegative_float, nargs="*", default=[1.5],
                   help="path-drop guidance scales (default 1.5; the model needs a route whose fusion can drop its deep path, e.g. sprint)")
    p.add_argument("--guidance-interval", type=nonnegative_float, nargs=2, default=None,
                   metavar=("SIGMA_LO", "SIGMA_HI"), help="guide only at noise levels inside (default: all)")
    p.add_argument("--num-samples", type=positive_int, default=None,
                   help="samples per setting (default: the run's train.eval.fid_num_samples)")
    p.add_argument("--out", required=True, help="output folder for guidance.md, guidance.json and the grids")
    return p


def evaluate(args) -> dict:
    path = resolve_checkpoint(args.run)
    net, config = load_sampling_net(path)
    cfg = OmegaConf.create(config)
    e = cfg.train.eval
    e.cfg_scales = [None, *args.cfg_scales]
    e.path_drop_scales = list(args.pdg_scales)
    e.guidance_interval = list(args.guidance_interval) if args.guidance_interval else None
    if args.num_samples:
        e.fid_num_samples = args.num_samples
    params = OmegaConf.to_container(cfg.model.params, resolve=True)
    flops = guidance_flops(cfg.model.backbone_type, params)
    if args.pdg_scales and not flops:
        raise UserError(f"{path} has no route whose fusion can drop its deep path (e.g. fusion: sprint), so no "
                        f"path-drop guidance; pass --pdg-scales with no value, or a run trained with such a route")
    full = flops.get("cfg_step_flops", 2 * sampling_forward_flops(cfg.model.backbone_type, params)) // 2
    out = Path(args.out)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    evaluator = TrainingEvaluator(cfg, accelerator, out)
    nfe = count_network_evaluations(dict(e.sampler))
    rows = []
    for suffix, options in list(evaluator.guidance):
        evaluator.guidance = [(suffix, options)]  # one setting per call: each is timed on its own
        start = time.perf_counter()
        scores = evaluator(net.to(accelerator.device), 0)
        seconds = time.perf_counter() - start
        guided = suffix != ""
        pass_flops = (flops["pdg_step_flops"] if suffix.startswith("_pdg") else 2 * full) if guided else full
        rows.append(dict(setting=suffix.lstrip("_") or "unguided", passes_per_evaluation=2 if guided else 1,
                         nfe=nfe, network_passes=nfe * (2 if guided else 1), gflops_per_sample=nfe * pass_flops / 1e9,
                         seconds=seconds, **{m: scores.get(f"{m}{suffix}") for m in METRICS}))
    return dict(checkpoint=str(path), num_samples=int(e.fid_num_samples), sampler=OmegaConf.to_container(e.sampler),
                guidance_interval=list(args.guidance_interval) if args.guidance_interval else None, rows=rows)


def write(result, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "guidance.json").write_text(json.dumps(result, indent=1))
    head = ["setting", "FID", "class_acc", "nn_ratio", "NFE", "network passes", "GFLOPs / sample", "seconds"]
    lines = [f"# Guidance on {result['checkpoint']}", "",
             f"{result['num_samples']} samples per setting, sampler {result['sampler']}, guidance interval "
             f"{result['guidance_interval'] or 'none (every step)'}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["setting"], *(f"{r[m]:.4g}" if r[m] is not None else "-" for m in METRICS), str(r["nfe"]),
                 str(r["network_passes"]), f"{r['gflops_per_sample']:.3g}", f"{r['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "guidance.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        result = evaluate(args)
        write(result, Path(args.out))
    except UserError as e:
        exit_with(str(e))
    except OSError as e:
        exit_with(f"cannot write to {args.out}: {e.strerror or e}")
    print(f"{len(result['rows'])} setting(s) -> {Path(args.out) / 'guidance.md'}")


if __name__ == "__main__":
    main()
