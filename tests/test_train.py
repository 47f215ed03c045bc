"""train.py end to end: configs, loss falls, exact resume after kill -9, signals, 2 processes, bad input."""
import json
import random
import signal
import time

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training.checkpoint import list_checkpoints, load_checkpoint
from conftest import REPO, assert_one_line_error, run_script, tiny_overrides
from train_runs import assert_bit_identical, final_state, read_metrics, records, run_train, start_train, wait_train
from dit import get_model


@pytest.mark.parametrize("model_name, routed", [("dit", False), ("tread", True)])
def test_models_build_from_hydra_configs(model_name, routed):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model_name}"])
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    assert model.router.enable_routing is routed
    assert len(model.blocks) == 12 and model.num_classes == 10
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        paper = compose("config", overrides=[f"model={model_name}", "dataset=imagenet256", "dataset.train_path=x"])
    assert paper.model.backbone_type == "DiT-B/2" and paper.train.general.batch_size == 256
    assert paper.train.optimizer.lr == 1e-4 and paper.train.ema.decay == 0.9999
    if routed:
        route, = OmegaConf.to_container(paper.model.params.routes)
        assert {k: route[k] for k in ("selection_ratio", "start_layer_idx", "end_layer_idx", "selection", "fusion")} \
            == dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=8, selection="random", fusion="none")
        assert route["schedule"]["kind"] == "constant"  # the paper's: a fixed ratio


def test_embedded_training_lowers_the_loss(tmp_path):
    run_script("train.py", f"results_dir={tmp_path}", "run_name=fall", "model=tread", "+model.params.depth=6",
               "+model.params.hidden_size=64", "model.params.routes.0.end_layer_idx=3", "train.max_steps=200",
               "train.logging.log_interval=20", "train.ckpt_every=200", "train.eval.eval_interval=0", check=True)
    losses = [r["loss"] for r in read_metrics(tmp_path / "fall")]
    assert len(losses) == 10
    assert losses[-1] < 0.75 * losses[0], losses
    assert (tmp_path / "fall" / "config.yaml").exists() and (tmp_path / "fall" / "tensorboard").is_dir()


def train_args(tmp_path, run_name, steps=120):
    return [f"results_dir={tmp_path}", f"run_name={run_name}", *tiny_overrides("tread"), f"train.max_steps={steps}",
            "train.ckpt_every=20", "train.logging.log_interval=10"]


def start_and_kill_after_checkpoint(tmp_path, run_name, sig, ckpt_step=40):
    """Start a 100,000-step run, so it cannot end before the signal, and send `sig` once the checkpoint of
    `ckpt_step` exists."""
    proc = start_train(*train_args(tmp_path, run_name, steps=100_000))
    target = tmp_path / run_name / "checkpoints" / f"ckpt_{ckpt_step:08d}.pt"
    deadline = time.time() + 240
    while not target.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, wait_train(proc, expect=None).stderr[-3000:]
    proc.send_signal(sig)
    return wait_train(proc, expect=128 + sig, timeout=120)


# Exact resume with in-training evaluation ON, as every real run has it: the model's default digits config
# (the real digits scorer, all metrics, nn_ratio), with a tiny model and a small evaluation for speed.
# Checkpoint and evaluation share a step, as in the default config.
EVAL_ON = ["train.eval.eval_interval=20", "train.eval.fid_num_samples=128", "train.eval.batch_size=64",
           "train.eval.sampler.num_steps=2"]


def resume_args(model, results_dir, run_name, *more):
    return [f"results_dir={results_dir}", f"run_name={run_name}", *tiny_overrides(model), *EVAL_ON,
            "train.max_steps=40", "train.ckpt_every=20", "train.logging.log_interval=10", *more]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """model -> the run directory of an uninterrupted run with evaluation on (trained once, on first use)."""
    root, runs = tmp_path_factory.mktemp("uninterrupted"), {}

    def get(model):
        if model not in runs:
            run_train(*resume_args(model, root, model))
            runs[model] = root / model
        return runs[model]
    return get


# (where the SIGKILL lands, step): inside step 22, after the checkpoint and evaluation of step 20 (the resumed
# run restarts at 20 and skips that evaluation); or between the checkpoint of step 20 and its evaluation.
@pytest.mark.parametrize("model", ["dit", "tread"])
@pytest.mark.parametrize("when, step", [("mid_step", 22), ("after_checkpoint", 20)])
def test_kill9_resume_is_bit_identical(tmp_path, uninterrupted, model, when, step):
    run_train(when, step, *resume_args(model, tmp_path, "killed"), script="tests/train_killed_at.py",
              expect=-signal.SIGKILL)
    assert final_state(tmp_path / "killed")["step"] == 20
    evaluated_20 = 20 in records(tmp_path / "killed", "fid")
    assert evaluated_20 == (when == "mid_step"), "the kill landed where intended"
    resumed = run_train(*resume_args(model, tmp_path, "killed"))
    assert "resuming from" in resumed.stdout and "at step 20" in resumed.stdout
    straight = uninterrupted(model)
    assert_bit_identical(final_state(straight), final_state(tmp_path / "killed"))
    assert records(tmp_path / "killed", "loss") == records(straight, "loss"), "redone steps are logged once"
    fids, straight_fids = records(tmp_path / "killed", "fid"), records(straight, "fid")
    assert fids == {s: straight_fids[s] for s in fids} and 40 in fids, "evaluation is deterministic too"


def test_logged_throughput_leaves_out_evaluations_inside_a_log_interval(tmp_path):
    """On a fake clock (1 s per step, 1000 s per evaluation; tests/train_clocked.py) every logged steps/s is
    exactly 1, also for intervals with an evaluation inside (every 5 steps, logging every 10)."""
    run_script("tests/train_clocked.py", f"results_dir={tmp_path}", "run_name=clock", *tiny_overrides("dit"),
               "train.max_steps=20", "train.ckpt_every=20", "train.logging.log_interval=10",
               "train.eval.eval_interval=5", "train.eval.fid_num_samples=128", check=True)
    logged = [(r["step"], r["steps_per_sec"]) for r in read_metrics(tmp_path / "clock") if "steps_per_sec" in r]
    assert logged == [(10, 1.0), (20, 1.0)]


@pytest.mark.parametrize("model", ["dit", "tread"])
def test_evaluation_does_not_change_training(tmp_path, uninterrupted, model):
    run_train(*resume_args(model, tmp_path, "no_eval", "train.eval.eval_interval=0"))
    assert not records(tmp_path / "no_eval", "fid") and records(uninterrupted(model), "fid")
    assert_bit_identical(final_state(uninterrupted(model)), final_state(tmp_path / "no_eval"))


def test_evaluation_puts_back_every_random_stream_it_draws_from(tmp_path, monkeypatch):
    """The runs above show evaluation leaves training unchanged, but today's evaluation draws nothing from the
    global streams (one generator per seed). Here it does (torch, numpy and Python draws before each
    sampling): the evaluator's set-up and call still leave all three where they were."""
    from accelerate import Accelerator

    from training import in_training_eval
    from training.checkpoint import build_denoiser, capture_rng_state

    sample = in_training_eval.generate

    def generate_drawing(*args, **kwargs):
        torch.rand(3), np.random.rand(3), random.random()
        return sample(*args, **kwargs)

    monkeypatch.setattr(in_training_eval, "generate", generate_drawing)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*tiny_overrides("dit"), "train.eval.fid_num_samples=128",
                                           "train.eval.batch_size=128", "train.eval.sampler.num_steps=2"])
    torch.manual_seed(0)
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    net = build_denoiser(cfg.diffuser, model).eval()
    np.random.seed(0), random.seed(0)
    before = capture_rng_state()
    evaluator = in_training_eval.TrainingEvaluator(cfg, Accelerator(cpu=True), tmp_path)
    assert "fid" in evaluator(net, 1)
    after = capture_rng_state()
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
    assert torch.equal(before["numpy"]["keys"], after["numpy"]["keys"]) and before["numpy"]["pos"] == after["numpy"]["pos"]


def test_sigterm_saves_a_checkpoint_then_resume_finishes(tmp_path):
    out = start_and_kill_after_checkpoint(tmp_path, "term", signal.SIGTERM, ckpt_step=20).stdout
    step = final_state(tmp_path / "term")["step"]
    assert "stopped by signal" in out and f"at step {step}" in out and step >= 20
    assert not (tmp_path / "term" / "run.lock").exists(), "a run stopped by a signal releases its lock"
    resumed = run_train(*train_args(tmp_path, "term", steps=step + 20))
    assert f"at step {step}" in resumed.stdout and final_state(tmp_path / "term")["step"] == step + 20


def test_resume_false_moves_the_old_run_aside(tmp_path):
    args = [f"results_dir={tmp_path}", "run_name=again", *tiny_overrides("dit"), "train.max_steps=10",
            "train.ckpt_every=10", "train.logging.log_interval=5"]
    run_script("train.py", *args, check=True)
    proc = run_script("train.py", *args, check=True)
    assert "already complete" in proc.stdout
    run_script("train.py", *args, "resume=false", check=True)
    backups = [p for p in tmp_path.iterdir() if p.name.startswith("again.replaced-")]
    assert len(backups) == 1 and list_checkpoints(backups[0] / "checkpoints")
    assert [r["step"] for r in read_metrics(tmp_path / "again")] == [5, 10]
    status = {d.name: json.loads((d / "status.json").read_text())["status"] for d in (backups[0], tmp_path / "again")}
    assert status == {backups[0].name: "completed", "again": "completed"}  # the old run keeps its own status


def test_two_processes_log_one_reduced_loss(tmp_path):
    """Two processes (tests/train_traced.py records each rank): identical weights on both ranks after the steps
    (gradients are averaged), the logged loss is the mean over ranks and steps of the ranks' own losses, and
    in an epoch the ranks see disjoint samples that together cover the whole dataset (1500 digits, 6 global
    batches of 250: the run is one epoch)."""
    run_train(f"results_dir={tmp_path}", "run_name=ddp", *tiny_overrides("tread"), "train.general.batch_size=250",
              "train.max_steps=6", "train.ckpt_every=6", "train.logging.log_interval=3",
              script="tests/train_traced.py", processes=2)
    logged = read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in logged] == [3, 6], "rank 0 alone writes, once per log step"
    assert all(r["world_size"] == 2 for r in logged)
    state = final_state(tmp_path / "ddp")
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"]), "ranks draw different noise"

    ranks = [torch.load(tmp_path / "ddp" / f"trace_rank{r}.pt") for r in (0, 1)]
    for name, value in state["model"].items():
        assert torch.equal(ranks[0]["model"][name], value) and torch.equal(ranks[1]["model"][name], value), name
    losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64)  # [rank, step]
    assert losses.shape == (2, 6) and not torch.equal(losses[0], losses[1])
    for record, steps in zip(logged, (slice(0, 3), slice(3, 6))):
        assert record["loss"] == pytest.approx(losses[:, steps].mean().item(), rel=1e-6)
    epoch = [set(sum(r["batches"][:6], [])) for r in ranks]
    assert all(len(b) == 125 for r in ranks for b in r["batches"][:6])
    assert len(epoch[0]) == len(epoch[1]) == 750 and not epoch[0] & epoch[1]
    assert epoch[0] | epoch[1] == set(range(1500))


def bad(tmp_path, *overrides):
    return run_script("train.py", f"results_dir={tmp_path}", *tiny_overrides("tread"), "train.max_steps=4",
                      "train.ckpt_every=2", *overrides)


@pytest.mark.parametrize("overrides, needle", [
    (["model.params.routes.0.end_layer_idx=9"], "outside a model of depth 4"),
    (["model.params.routes.0.start_layer_idx=3"], "comes after"),
    (["model.params.routes.0.selection_ratio=1.0"], "selection_ratio"),
    (["model.params.routes=[{start_layer_idx:1,end_layer_idx:2,selection_ratio:0.5},"
      "{start_layer_idx:2,end_layer_idx:3,selection_ratio:0.5}]"], "overlaps"),
    (["model.backbone_type=DiT-Q/2"], "unknown backbone"),
    (["dataset=imagenet256", "dataset.train_path=/does/not/exist"], "/does/not/exist"),
    (["dataset=imagenet256"], "dataset.train_path"),
    (["train.general.grad_accum_steps=3"], "grad_accum_steps"),
    (["model.params.init=xavier"], "model.params.init"),
    (["train.eval.eval_interval=2", "train.general.class_drop_prob=0", "train.eval.cfg_scales=[null,1.5]"],
     "no unconditional mode"),
])
def test_bad_config_is_one_clear_line(tmp_path, overrides, needle):
    assert_one_line_error(bad(tmp_path, *overrides), needle)


def test_truncated_or_foreign_checkpoint_is_refused_and_untouched(tmp_path):
    first = bad(tmp_path, "run_name=c")
    assert first.returncode == 0, first.stderr[-3000:]
    newest = list_checkpoints(tmp_path / "c" / "checkpoints")[-1][1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    assert_one_line_error(bad(tmp_path, "run_name=c", "train.max_steps=8"), str(newest), "truncated")
    assert newest.read_bytes() == data[: len(data) // 2]
    newest.write_bytes(data)
    assert_one_line_error(bad(tmp_path, "run_name=c", "train.max_steps=8", "+model.params.mlp_ratio=2"),
                          "belongs to another model")
    assert newest.read_bytes() == data


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    proc = bad(tmp_path, "run_name=nan", "train.optimizer.lr=1e30", "train.max_steps=40", "train.ckpt_every=1",
               "train.logging.log_interval=1000")
    line = assert_one_line_error(proc, "NaN/inf at step")
    kept = list_checkpoints(tmp_path / "nan" / "checkpoints")
    bad_step = int(line.split("at step ")[1].split(";")[0])
    assert all(step < bad_step for step, _ in kept)
    for _, path in kept:
        state = load_checkpoint(path)
        assert all(torch.isfinite(v).all() for v in state["model"].values())


@pytest.mark.parametrize("accum", [2, 4])
def test_gradient_accumulation_equals_one_step_on_the_whole_batch(accum):
    """k micro-batches give the gradient and the loss of one pass over the whole batch (a loss without
    random draws, so only float rounding differs)."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from training.loop import accumulate_gradients

    torch.manual_seed(0)
    model = get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=8, depth=2, hidden_size=32,
                                      num_heads=2)).eval()  # eval: no routing draws
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))

    def loss_fn(net, images, labels):
        return (net(images, torch.full((len(images),), 0.3), labels) - images) ** 2

    def grads(k):
        model.zero_grad()
        batches = iter(zip(x.chunk(k), y.chunk(k)))
        run = SimpleNamespace(accelerator=Accelerator(cpu=True), data_iter=batches, net=model, loss_fn=loss_fn,
                              accum=k, projector=None)
        loss = accumulate_gradients(run, num_classes=10, drop_prob=0.0)
        return loss, [p.grad.clone() for p in model.parameters()]

    (loss_1, g_1), (loss_k, g_k) = grads(1), grads(accum)
    torch.testing.assert_close(loss_k, loss_1, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_k, g_1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_run_counts_optimizer_steps(tmp_path):
    run_script("train.py", f"results_dir={tmp_path}", "run_name=acc", *tiny_overrides("tread"),
               "train.general.grad_accum_steps=2", "train.max_steps=4", "train.ckpt_every=2",
               "train.logging.log_interval=2", check=True)
    assert [r["step"] for r in read_metrics(tmp_path / "acc")] == [2, 4]
    assert [s for s, _ in list_checkpoints(tmp_path / "acc" / "checkpoints")] == [2, 4]
    state = final_state(tmp_path / "acc")
    assert all(v["step"].item() == 4 for v in state["optimizer"]["state"].values())  # AdamW stepped 4 times


def test_warmup_rises_linearly_then_holds_and_is_off_by_default():
    from omegaconf import OmegaConf

    from training.loop import learning_rate

    warm = OmegaConf.create({"lr": 1e-3, "warmup_steps": 4})
    assert [learning_rate(warm, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        paper = compose("config", overrides=["dataset=imagenet256", "dataset.train_path=x"])
    assert paper.train.optimizer.warmup_steps == 0 and learning_rate(paper.train.optimizer, 0) == 1e-4
