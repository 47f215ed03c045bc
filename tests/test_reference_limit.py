"""lab/digits_reference_limit.py: each draw scores the training digits it names with the in-training metrics
(evaluate_digits, class_accuracy) against the held-out split, the table is mean ± sample std over the draws, and
bad input is one error line."""
import json
import statistics

import numpy as np
import pytest

from conftest import assert_one_line_error, run_script
from data.digits import load_digits_split
from evaluations.digits_classifier import class_accuracy, evaluate_digits, load_digits_classifier


def test_draws_are_the_named_training_digits_scored_like_samples(tmp_path):
    run_script("lab.digits_reference_limit", "--num-samples", 64, "--draws", 2, "--seed", 5, "--out", tmp_path,
               check=True)
    result = json.loads((tmp_path / "reference_limit.json").read_text())
    assert (result["num_samples"], result["reference_size"], result["train_size"]) == (64, 297, 1500)
    images, labels = load_digits_split("train", 16)
    rows = np.random.default_rng(6).choice(1500, 64, replace=False)  # the second draw: seed 5 + 1
    classifier = load_digits_classifier(device="cpu")
    by_hand = evaluate_digits(images[rows], classifier)
    assert result["draws"][1]["fid"] == pytest.approx(by_hand["fid"], rel=1e-6)
    assert result["draws"][1]["precision"] == pytest.approx(by_hand["precision"])
    assert result["draws"][1]["class_acc"] == pytest.approx(class_accuracy(images[rows], labels[rows], classifier))
    assert result["draws"][0]["fid"] != result["draws"][1]["fid"]
    fids = [d["fid"] for d in result["draws"]]
    md = (tmp_path / "reference_limit.md").read_text()
    assert f"| {statistics.mean(fids):.4g} ± {statistics.stdev(fids):.2g} |" in md
    assert f"| all 1500 training digits | {result['whole_split']['fid']:.4g} |" in md


@pytest.mark.parametrize("args, needle", [(["--num-samples", "2"], "at least 4"), (["--draws", "0"], "--draws")])
def test_bad_input_is_one_error_line(tmp_path, args, needle):
    assert_one_line_error(run_script("lab.digits_reference_limit", *args, "--out", tmp_path), needle)
    assert not (tmp_path / "reference_limit.json").exists()
