"""init_from: a new run starts from another run's weights (the paper's "(F)" fine-tuning without routing)."""
import shutil

import torch

from tools import export
from training.checkpoint import list_checkpoints, load_checkpoint
from conftest import TINY_MODEL, TINY_TRAIN, assert_one_line_error, run_script, tiny_overrides

LR, DECAY = 1e-3, 0.995  # the fine-tune's one step: no warm-up, so its learning rate is exactly LR


def newest(run_dir):
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])


def fine_tune(tmp_path, name, *more):
    proc = run_script("train.py", f"results_dir={tmp_path}", f"run_name={name}", *tiny_overrides("dit"),
                      f"init_from={tmp_path / 'src'}", "train.max_steps=1", "train.ckpt_every=1",
                      f"train.optimizer.lr={LR}", "train.optimizer.warmup_steps=0", f"train.ema.decay={DECAY}",
                      *more, check=True)
    return proc, newest(tmp_path / name)


def test_init_from_loads_weights_and_refuses_other_shapes(tmp_path):
    """One fine-tune step from the source: the EMA is exactly lerp(source EMA, new weights, 1 - decay), every
    weight moved by at most one first AdamW step (|update| <= lr) from the source's *model* weights, and the
    optimizer starts fresh (step 1) or continues the source's (step 6 + 1, second moments carried over);
    init_from_weights=ema starts the model within one step of the source's *EMA*."""
    run_script("train.py", f"results_dir={tmp_path}", "run_name=src", *tiny_overrides("tread"), "train.max_steps=6",
               "train.ckpt_every=6", "train.optimizer.warmup_steps=0", check=True)  # full steps: model and EMA apart
    source = newest(tmp_path / "src")
    proc, tuned = fine_tune(tmp_path, "ft")
    assert "initialised from" in proc.stdout and "fresh optimizer" in proc.stdout
    assert tuned["step"] == 1 and tuned["config"]["model"]["params"]["enable_routing"] is False
    for name, value in source["ema"].items():
        assert torch.equal(tuned["ema"][name], torch.lerp(value, tuned["model"][name], 1 - DECAY)), name
    moved = {name: (tuned["model"][name] - value).abs().max().item() for name, value in source["model"].items()}
    assert max(moved.values()) <= LR * (1 + 1e-5), moved
    assert sum(m > LR / 2 for m in moved.values()) > len(moved) // 2, "the step did move the weights"
    assert all(s["step"].item() == 1 for s in tuned["optimizer"]["state"].values())
    assert len(tuned["optimizer"]["state"]) == len(source["optimizer"]["state"])

    proc, carried = fine_tune(tmp_path, "ft_opt", "init_from_optimizer=true")
    assert "with its optimizer state" in proc.stdout
    beta2 = source["config"]["train"]["optimizer"]["betas"][1]
    for key, before in source["optimizer"]["state"].items():
        after = carried["optimizer"]["state"][key]
        assert after["step"].item() == 7 and before["step"].item() == 6
        # v' = beta2 v + (1 - beta2) g^2 >= beta2 v: a fresh v (g^2 alone) falls below beta2 v where g is small
        assert (after["exp_avg_sq"] >= beta2 * before["exp_avg_sq"] * (1 - 1e-6)).all(), key

    # SPRINT's fine-tune: the source's EMA as the new model and the new EMA (it differs from the source's model
    # by more than one step could move a weight, so the two starts are told apart)
    assert max((source["model"][n] - v).abs().max().item() for n, v in source["ema"].items()) > 2 * LR
    proc, from_ema = fine_tune(tmp_path, "ft_ema", "init_from_weights=ema")
    assert "its EMA as the model" in proc.stdout
    for name, value in source["ema"].items():
        assert torch.equal(from_ema["ema"][name], torch.lerp(value, from_ema["model"][name], 1 - DECAY)), name
        assert (from_ema["model"][name] - value).abs().max().item() <= LR * (1 + 1e-5), name

    wider = [o for o in TINY_MODEL if "hidden_size" not in o] + ["+model.params.hidden_size=64"]
    deeper = [o for o in TINY_MODEL if "depth" not in o] + ["+model.params.depth=6"]
    export.main([str(tmp_path / "src"), "--out", str(tmp_path / "exported")])
    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "exported", truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    for name, overrides, needle in (
            ("wider", ["model=dit", *wider, *TINY_TRAIN], "the source has hidden_size 32, this config 64 "
                                                          "(model.params.hidden_size)"),
            ("deeper", ["model=dit", *deeper, *TINY_TRAIN], "the source has depth 4, this config 6"),
            ("nope", [*tiny_overrides("dit"), f"init_from={tmp_path / 'nope'}"], "does not exist"),
            ("opt", [*tiny_overrides("dit"), f"init_from={tmp_path / 'exported'}", "init_from_optimizer=true"],
             "holds no optimizer state"),
            ("cut", [*tiny_overrides("dit"), f"init_from={truncated}"], "cannot be read as safetensors")):
        bad = run_script("train.py", f"results_dir={tmp_path}", f"run_name={name}", f"init_from={tmp_path / 'src'}",
                         *overrides, "train.max_steps=1")
        assert_one_line_error(bad, needle)
        assert not (tmp_path / name).exists(), f"{name}: a refused run leaves no run folder"


def test_init_from_onto_a_run_that_would_resume_is_refused_unless_it_began_there(tmp_path):
    """A run folder with checkpoints resumes from them. init_from naming another source there (the baseline of
    the quick start, say) is refused in one line, its checkpoints untouched; a fine-tune resumed by its own
    command (same init_from) goes on."""
    common = (f"results_dir={tmp_path}", *tiny_overrides("dit"), "train.ckpt_every=1")
    run_script("train.py", "run_name=src", *common, "train.max_steps=1", check=True)
    run_script("train.py", "run_name=base", *common, "train.max_steps=1", check=True)
    before = (tmp_path / "base" / "checkpoints" / "ckpt_00000001.pt").read_bytes()
    refused = run_script("train.py", "run_name=base", *common, f"init_from={tmp_path / 'src'}", "train.max_steps=2")
    assert_one_line_error(refused, f"init_from={tmp_path / 'src'} would be ignored: {tmp_path / 'base'} already holds "
                                   "checkpoints of a run started from scratch")
    assert (tmp_path / "base" / "checkpoints" / "ckpt_00000001.pt").read_bytes() == before
    assert list_checkpoints(tmp_path / "base" / "checkpoints")[-1][0] == 1
    ft = (*common, "run_name=ft", f"init_from={tmp_path / 'src'}")
    run_script("train.py", *ft, "train.max_steps=1", check=True)
    resumed = run_script("train.py", *ft, "train.max_steps=2", check=True)
    assert "resuming from" in resumed.stdout and newest(tmp_path / "ft")["step"] == 2
