"""Routing ratio schedules and train.routing_off_after: values per step, pure in the step, exact resume."""
import math

import pytest
import torch

from hydra import compose, initialize_config_dir

from conftest import REPO, tiny_overrides
from routing_module import RouteError, TokenRouter, resolve_routes
from test_routing import inputs, record_block_io, route, small_model
from test_train import assert_bit_identical, final_state
from training.config_check import check_train_config
from training.flops import format_report, routing_flop_report
from training.loop import training_loop


def scheduled(kind="linear", **extra):
    schedule = dict(kind=kind, start_ratio=0.2, end_ratio=0.6, start_step=10, end_step=20, **extra)
    return dict(route(1, 3, 0.5), schedule=schedule)


def ratios(routes, steps, off_after=None):
    router = TokenRouter(resolve_routes(routes, 6)).train()
    out = []
    for step in steps:
        router.set_step(step, off_after)
        out.append(router.active_ratios(None)[0])
    return out


def test_schedule_values_at_given_steps():
    assert ratios([route(1, 3, 0.5)], [0, 10**6]) == [0.5, 0.5]  # constant: selection_ratio throughout
    assert ratios([scheduled()], [0, 10, 15, 20, 99]) == pytest.approx([0.2, 0.2, 0.4, 0.6, 0.6])
    cosine = ratios([scheduled("cosine")], [10, 12, 15, 20])
    assert cosine == pytest.approx([0.2, 0.2 + 0.4 * 0.5 * (1 - math.cos(math.pi * 0.2)), 0.4, 0.6])
    # levels=3: only 0.2, 0.4, 0.6 ever occur (one compiled graph each)
    assert ratios([scheduled(levels=3)], [10, 12, 13, 17, 18, 20]) == pytest.approx([0.2, 0.2, 0.4, 0.4, 0.6, 0.6])
    start_null = dict(scheduled(), schedule=dict(kind="linear", end_ratio=0.0, end_step=4))
    assert ratios([start_null], [0, 2, 4]) == pytest.approx([0.5, 0.25, 0.0])  # starts at selection_ratio


def test_routing_off_after_step():
    assert ratios([scheduled()], [15, 29, 30, 31], off_after=30) == pytest.approx([0.4, 0.6, 0.0, 0.0])
    model = small_model([route(1, 3, 0.5)]).train()
    seen, _ = record_block_io(model)
    for step in (4, 5):
        model.router.set_step(step, off_after=5)
        model(*inputs())
    assert [x.shape[1] for i, x, _ in seen if i == 2] == [32, 64]


def test_ratio_depends_only_on_the_step():
    forward = ratios([scheduled()], list(range(25)))
    shuffled = [7, 24, 0, 15, 3, 20, 11, 15]
    assert ratios([scheduled()], shuffled) == [forward[s] for s in shuffled]
    model = small_model([scheduled()]).train()
    seen, _ = record_block_io(model)
    for step in (15, 0, 15):
        model.router.set_step(step)
        model(*inputs())
    assert [x.shape[1] for i, x, _ in seen if i == 2] == [39, 52, 39]  # 64 - int(64 * ratio)


@pytest.mark.parametrize("schedule, needle", [
    (dict(kind="step"), "schedule.kind"), (dict(kind="linear", end_ratio=0.5), "end_step"),
    (dict(kind="linear", end_ratio=1.0, end_step=5), "end_ratio"),
    (dict(kind="linear", end_ratio=0.5, start_step=5, end_step=5), "start_step < end_step"),
    (dict(kind="cosine", end_ratio=0.5, end_step=5, levels=1), "levels"),
    (dict(kind="linear", end_ratio=0.5, end_stp=5), "unknown schedule key")])
def test_bad_schedule_is_one_clear_line(schedule, needle):
    with pytest.raises(RouteError, match=needle):
        resolve_routes([dict(route(1, 3), schedule=schedule)], 6)


def test_flop_report_gives_the_schedule_start_and_end():
    params = dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, routes=[scheduled()], depth=6,
                  hidden_size=32, num_heads=2)
    report = routing_flop_report("DiT-T/2", params, 1)
    assert report["schedule_end_step"] == 20
    assert report["flops_per_step_routed_end"] < report["flops_per_step_routed"] < report["flops_per_step_dense"]
    assert "from step 20 on" in format_report("DiT-T/2", report, 1)


SCHEDULE = ["model.params.routes.0.schedule.kind=linear", "model.params.routes.0.schedule.end_ratio=0.25",
            "model.params.routes.0.schedule.end_step=4", "train.routing_off_after=5", "train.ckpt_every=3",
            "train.logging.log_interval=2", "train.eval.eval_interval=0", "train.general.num_workers=0",
            "train.cpu_threads=1", "train.general.batch_size=4"]


def test_resume_under_a_schedule_equals_an_uninterrupted_run(tmp_path, capsys):
    """In this process (three launches of train.py would take a minute): 6 steps straight, and 3 + 3 resumed.
    The log names the model as configured and says when routing goes off."""
    def train(name, steps):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={tmp_path}", f"run_name={name}",
                                               *tiny_overrides("tread"), *SCHEDULE, f"train.max_steps={steps}"])
        training_loop(check_train_config(cfg), end_training=False)

    train("straight", 6)
    out = capsys.readouterr().out
    assert "DiT-D/4 with depth 4, hidden_size 32, num_heads 2 (tread): " in out
    assert "routes 1->2 at 0.5 (random selection, linear schedule), off from step 5 (train.routing_off_after)" in out
    assert out.count("step 5: routing off from here on (train.routing_off_after=5)") == 1
    train("resumed", 3)
    train("resumed", 6)
    assert_bit_identical(final_state(tmp_path / "straight"), final_state(tmp_path / "resumed"))
