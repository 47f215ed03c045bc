"""init_from: a new run starts from another run's weights (the paper's "(F)" fine-tuning without routing)."""
import torch

from training.checkpoint import list_checkpoints, load_checkpoint
from conftest import TINY_MODEL, TINY_TRAIN, assert_one_line_error, run_script, tiny_overrides


def test_init_from_loads_weights_and_refuses_other_shapes(tmp_path):
    run_script("train.py", f"results_dir={tmp_path}", "run_name=src", *tiny_overrides("tread"), "train.max_steps=6",
               "train.ckpt_every=6", check=True)
    source = load_checkpoint(list_checkpoints(tmp_path / "src" / "checkpoints")[-1][1])
    proc = run_script("train.py", f"results_dir={tmp_path}", "run_name=ft", *tiny_overrides("dit"),
                      f"init_from={tmp_path / 'src'}", "train.max_steps=1", "train.ckpt_every=1", check=True)
    assert "initialised from" in proc.stdout and "fresh optimizer" in proc.stdout
    tuned = load_checkpoint(list_checkpoints(tmp_path / "ft" / "checkpoints")[-1][1])
    assert tuned["step"] == 1
    for name, value in source["ema"].items():  # one EMA step (decay 0.995) away from the source EMA
        assert torch.allclose(tuned["ema"][name], value, atol=1e-3), name
    assert len(tuned["optimizer"]["state"]) > 0 and tuned["config"]["model"]["params"]["enable_routing"] is False
    wider = [o for o in TINY_MODEL if "hidden_size" not in o] + ["+model.params.hidden_size=64"]
    bad = run_script("train.py", f"results_dir={tmp_path}", "run_name=bad", "model=dit", *wider, *TINY_TRAIN,
                     f"init_from={tmp_path / 'src'}", "train.max_steps=1")
    assert_one_line_error(bad, "belongs to another model")
    missing = run_script("train.py", f"results_dir={tmp_path}", "run_name=bad2", *tiny_overrides("dit"),
                         f"init_from={tmp_path / 'nope'}", "train.max_steps=1")
    assert_one_line_error(missing, "does not exist")
