"""The LoRA + TREAD fine-tuning example (tools/finetune_lora.py) for a handful of steps, on its random FLUX
architecture and on a tiny random checkpoint folder given as --pretrained."""
import math
import re

import pytest
import torch

pytest.importorskip("peft")
from tools import finetune_lora  # noqa: E402
from tools.diffusers_toy import random_flux  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

FAST = ["--steps", "3", "--batch-size", "2", "--log-every", "1", "--time-rounds", "1", "--time-steps", "1",
        "--eval-samples", "8", "--threads", str(torch.get_num_threads())]  # keep the session's threads


def logged(path):
    return path.read_text().splitlines()


def test_random_flux_example_runs_and_logs(tmp_path):
    out = tmp_path / "log.txt"
    timing = finetune_lora.main([*FAST, "--resolution", "8", "--out", str(out)])
    lines = logged(out)
    assert sum("train loss" in line for line in lines) == 3 and sum("eval loss" in line for line in lines) == 2
    assert "speed-up / bound" in lines[-1]
    assert timing["flop_bound"] > 1.0 and timing["flops_routed"] < timing["flops_unrouted"]
    assert math.isfinite(timing["speedup"])


def test_compiled_blocks_train_as_the_eager_ones(tmp_path):
    """--compile (each block compiled, the checkpoint inside its graph; dynamo's eager backend: traced, no code
    generated; tests/test_diffusers_compile.py partitions as inductor does): the same losses as the eager run, and
    the FLOP bound counted as the eager model's."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "--compile-backend", "eager"])):
        out = tmp_path / f"{name}.txt"
        runs[name] = (finetune_lora.main([*FAST, "--resolution", "8", "--gradient-checkpointing", *extra, "--out",
                                          str(out)]), logged(out))
    losses = {name: [float(re.search(r"loss (?:\(unrouted, held-out\) )?([\d.]+)", line).group(1))
                     for line in lines if " loss " in line] for name, (_, lines) in runs.items()}
    assert len(losses["compiled"]) == 5 and "compiled blocks True" in runs["compiled"][1][1]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-3)
    assert runs["compiled"][0]["flops_routed"] == runs["eager"][0]["flops_routed"]


def test_pretrained_folder_is_fine_tuned_with_its_vae(tmp_path):
    from diffusers import AutoencoderKL

    random_flux(4, 32, 2, 1, 1, 16).save_pretrained(tmp_path / "transformer")
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                  up_block_types=("UpDecoderBlock2D",), block_out_channels=(8,), latent_channels=4,
                  norm_num_groups=8).save_pretrained(tmp_path / "vae")
    timing = finetune_lora.main([*FAST, "--resolution", "8", "--pretrained", str(tmp_path),
                                 "--route", "0.5", "0", "-1", "--gradient-checkpointing"])
    assert timing["flop_bound"] > 1.0


def test_pretrained_folder_without_a_transformer_is_refused(tmp_path):
    with pytest.raises(UserError, match="expected a diffusers folder with transformer/config.json and vae/"):
        finetune_lora.main([*FAST, "--pretrained", str(tmp_path)])


def test_help_shows_each_default(capsys):
    """--help gives every option's default; an option off by default says what its absence means instead."""
    with pytest.raises(SystemExit) as done:
        finetune_lora.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    options = [a for a in finetune_lora.build_parser()._actions if a.option_strings and a.dest != "help"]
    for action in options:
        if action.default in (None, False):
            assert action.help, action.dest
        else:
            assert f"(default: {action.default})" in text, action.dest
    assert "(default: 300)" in text and "(default: (0.5, 1, -2))" in text
