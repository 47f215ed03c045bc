"""The best scores a digits model can reach against the 297 held-out digits: real training digits, drawn as
many as an in-training evaluation samples, scored by the same metrics (the shipped digits classifier's FID, sFID,
IS, precision, recall and class_acc). A sampler that drew the training distribution perfectly would score
about this, so FID differences well inside the spread of these draws are not resolved by this reference set.

    python -m lab.digits_reference_limit --num-samples 512 --draws 10 --out docs/results/reference_limit

Each draw takes --num-samples training digits without replacement (with replacement above the 1,500 of the
training split) with its own seed; the table gives mean ± sample std over the draws, and one row for the whole
training split. Writes reference_limit.md and reference_limit.json.
"""
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from data.digits import load_digits_split
from evaluations.digits_classifier import (RESOLUTION, class_accuracy, digits_reference_statistics, evaluate_digits,
                                           load_digits_classifier)
from tread_utils.errors import exit_with
from tread_utils.cli import ArgumentParser, positive_int

METRICS = (("fid", "FID"), ("sfid", "sFID"), ("inception_score", "IS"), ("precision", "precision"),
           ("recall", "recall"), ("class_acc", "class_acc"))


def score(classifier, reference, images, labels) -> dict:
    scores = evaluate_digits(images, classifier, reference)
    return {**{k: scores[k] for k, _ in METRICS if k in scores}, "class_acc": class_accuracy(images, labels, classifier)}


def reference_limit(num_samples: int, draws: int, seed: int = 0) -> dict:
    """{'draws': [scores per draw], 'whole_split': scores of all training digits, 'num_samples', 'reference_size'}."""
    classifier = load_digits_classifier(device="cpu")
    reference = digits_reference_statistics(classifier)
    images, labels = load_digits_split("train", RESOLUTION)
    out = []
    for d in range(draws):
        rows = np.random.default_rng(seed + d).choice(len(images), num_samples, replace=num_samples > len(images))
        out.append(score(classifier, reference, images[rows], labels[rows]))
    return {"num_samples": num_samples, "reference_size": len(reference["labels"]), "train_size": len(images),
            "seed": seed, "draws": out, "whole_split": score(classifier, reference, images, labels)}


def markdown(result: dict) -> str:
    def cells(values):
        return [f"{statistics.mean(v):.4g} ± {statistics.stdev(v):.2g}" if len(v) > 1 else f"{v[0]:.4g}"
                for v in values]
    draws = result["draws"]
    rows = [[f"{result['num_samples']} training digits ({len(draws)} draws, seeds {result['seed']}.."
             f"{result['seed'] + len(draws) - 1})", *cells([[d[k] for d in draws] for k, _ in METRICS])],
            [f"all {result['train_size']} training digits", *cells([[result["whole_split"][k]] for k, _ in METRICS])]]
    header = ["real digits against the " f"{result['reference_size']} held-out", *(name for _, name in METRICS)]
    return "\n".join(["# Reference-set limit of the digits metrics", "",
                      "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows), ""])


def build_parser():
    p = ArgumentParser(prog="python -m lab.digits_reference_limit", description=__doc__.split("\n")[0])
    p.add_argument("--num-samples", type=positive_int, default=512, help="training digits per draw (default 512, "
                   "the toy study's evaluation size)")
    p.add_argument("--draws", type=positive_int, default=10, help="draws, each with its own seed (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first draw (default 0)")
    p.add_argument("--out", required=True, help="output folder for reference_limit.md and reference_limit.json")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.num_samples < 4:
        exit_with(f"--num-samples {args.num_samples} is too few: precision and recall need at least 4")
    result = reference_limit(args.num_samples, args.draws, args.seed)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "reference_limit.json").write_text(json.dumps(result, indent=1))
        (out / "reference_limit.md").write_text(markdown(result))
    except OSError as e:
        exit_with(f"cannot write the reference limit to {out}: {e.strerror or e}")
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
