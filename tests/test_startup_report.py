"""What a launch says about itself when it starts: each route's selection rule with its options, and a launch
that runs fewer processes than accelerate was asked for."""
from hydra import compose, initialize_config_dir

from conftest import REPO, tiny_overrides
from training.config_check import check_train_config
from training.loop import training_loop
from training.run_log import launch_shortfall

# what accelerate's plain launcher (`accelerate launch --cpu --num_processes 2`) gives the one process it starts
PLAIN_LAUNCHER_ASKED_FOR_TWO = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_startup_names_selection_options_and_a_launch_that_started_one_process(tmp_path, capsys, monkeypatch):
    """One step in this process, launched as the plain launcher launches: the start-up line names the route's
    rule and its options, and one warning line says the run trains on one process and names --multi_gpu."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in PLAIN_LAUNCHER_ASKED_FOR_TWO.items():
        monkeypatch.setenv(name, value)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[
            f"results_dir={tmp_path}", "run_name=importance", *tiny_overrides("tread"),
            "model.params.routes.0.selection=importance", "+model.params.routes.0.options.importance_mix=0.25",
            "train.max_steps=1", "train.ckpt_every=1", "train.logging.log_interval=1", "train.general.num_workers=0",
            "train.cpu_threads=1", "train.general.batch_size=4"])
    training_loop(check_train_config(cfg), end_training=False)
    out = capsys.readouterr().out
    assert "routes 1->2 at 0.5 (importance selection importance_mix=0.25), 1 process(es) on cpu" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "trains on 1 process" in warnings[0], out
    assert "accelerate launch --multi_gpu --num_processes N" in warnings[0]


def test_no_shortfall_without_the_plain_launchers_marks():
    assert launch_shortfall(1, {}) == ""  # python train.py
    assert launch_shortfall(1, {"ACCELERATE_USE_CPU": "False"}) == ""  # accelerate launch, one process asked
    assert launch_shortfall(2, {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}) == ""  # --multi_gpu (torchrun)
    assert launch_shortfall(2, PLAIN_LAUNCHER_ASKED_FOR_TWO) == ""  # the plain launcher under MPI: all of them run
    assert launch_shortfall(1, PLAIN_LAUNCHER_ASKED_FOR_TWO).startswith("warning: ")
