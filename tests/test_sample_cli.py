"""sample.py and generation.py: ADM layout, grid, seeds, batch-size and process-count invariance, run
directories, guidance options and one-line errors for bad input.

Real subprocesses (started concurrently, to stay fast on 2 cores) cover the reference run, `accelerate
launch` with 2 processes and a few bad inputs; the other cases call `sample.main(argv)` in-process, which
is the same code path minus the interpreter start-up (an exception escaping it would fail the test).
"""
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import sample
import generation
from training import checkpoint as ckpt
from tread_utils.files import check_output_path
from training.checkpoint import list_checkpoints, load_checkpoint
from conftest import REPO, assert_one_line_error, run_script, subprocess_env, tiny_overrides
from data.decoders import IdentityDecoder
from edm.guidance import ClassifierFreeGuidance, RoutingGuidance
from tread_utils.errors import UserError

FAST = ["sampler.num_steps=6", "progress=false"]


def start(args, launcher=()):
    return subprocess.Popen([sys.executable, *launcher, str(REPO / "sample.py"), *map(str, args)], cwd=REPO,
                            env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=300):
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_npz(path):
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A 4-step tiny TREAD run with checkpoints at steps 2 and 4 (high lr so the weights really move)."""
    root = tmp_path_factory.mktemp("sample_run")
    run_script("train.py", f"results_dir={root}", "run_name=tiny", *tiny_overrides("tread"), "train.max_steps=4",
               "train.ckpt_every=2", "train.logging.log_interval=2", "train.optimizer.lr=1e-2",
               "train.ema.decay=0.5", check=True)
    run_dir = root / "tiny"
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    return run_dir


@pytest.fixture(scope="session")
def newest(trained_run):
    return list_checkpoints(trained_run / "checkpoints")[-1][1]


SUBPROCESS_BAD_CASES = {  # name -> (args(root, newest checkpoint), what the one error line must say)
    "missing_checkpoint": (lambda root, newest: [f"ckpt={root}/nothing.pt"], "does not exist"),
    "malformed_seeds": (lambda root, newest: [f"ckpt={newest}", "seeds=0-9,x"], "seeds"),
    "unwritable_out": (lambda root, newest: [f"ckpt={newest}", f"out={root}/no/such/dir/s.npz"], "cannot write"),
}


def sample_here(capsys, *args):
    """sample.py in this process: a CompletedProcess with its exit code, stdout and stderr."""
    capsys.readouterr()
    code = 0
    try:
        sample.main([*FAST, *map(str, args)])  # the case's own options last: Hydra applies them in order
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # leave no Accelerator behind for other tests
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["sample.py", *args], code, out, err)


@pytest.fixture(scope="session")
def cli_runs(trained_run, newest, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    procs = {
        "ref": start([f"ckpt={newest}", "num_samples=10", "batch_size=4", f"out={out}/ref.npz",
                      f"grid={out}/grid.png", *FAST]),
        "two": start([f"ckpt={trained_run}", "seeds=0-9", "batch_size=3", f"out={out}/two.npz", *FAST], launch),
    }
    for name, (args, _) in SUBPROCESS_BAD_CASES.items():
        (out / name).mkdir()
        procs[name] = start(["num_samples=2", f"out={out / name}/s.npz", *args(out, newest), *FAST])
    results = finish(procs)
    return out, results


def test_adm_layout_grid_and_seed_labels(cli_runs):
    out, results = cli_runs
    ok(results["ref"])
    ref = load_npz(out / "ref.npz")
    assert sorted(ref) == ["arr_0", "arr_1"]
    assert ref["arr_0"].dtype == np.uint8 and ref["arr_0"].shape == (10, 16, 16, 3)
    assert ref["arr_1"].dtype == np.int64 and ref["arr_1"].shape == (10,)
    assert ref["arr_0"].std() > 0 and (ref["arr_0"][..., 0] == ref["arr_0"][..., 2]).all()  # grey digits
    # A seed's label is drawn from its own generator, after its latents.
    expected = []
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        torch.randn((1, 16, 16), generator=g)
        expected.append(int(torch.randint(10, size=(), generator=g)))
    assert ref["arr_1"].tolist() == expected
    with Image.open(out / "grid.png") as grid:
        assert grid.format == "PNG" and grid.size[0] >= 512  # one row per class drawn: see tests/test_grids.py
    assert "class_acc" in results["ref"].stdout
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers  # no temporary or probe files


def test_run_dir_and_batch_size_give_identical_arrays(cli_runs, trained_run, tmp_path, capsys):
    out, _ = cli_runs
    result = ok(sample_here(capsys, f"ckpt={trained_run}", "seeds=0-9", "batch_size=3", f"out={tmp_path}/s.npz"))
    assert "ckpt_00000004.pt" in result.stdout  # the newest checkpoint of the run
    ref, other = load_npz(out / "ref.npz"), load_npz(tmp_path / "s.npz")
    np.testing.assert_array_equal(ref["arr_0"], other["arr_0"])
    np.testing.assert_array_equal(ref["arr_1"], other["arr_1"])


def test_two_processes_match_one(cli_runs):
    out, results = cli_runs
    ok(results["two"])
    assert "2 process(es)" in results["two"].stdout
    assert results["two"].stdout.count("wrote ") == 1  # only the main process writes
    ref, two = load_npz(out / "ref.npz"), load_npz(out / "two.npz")
    np.testing.assert_array_equal(ref["arr_0"], two["arr_0"])
    np.testing.assert_array_equal(ref["arr_1"], two["arr_1"])


GUIDANCE = {  # name -> (sample.py options, the same guidance built by hand around the EMA net)
    "cfg": (["cfg_scale=2", "guidance_interval=[0.3,5]"],
            lambda net: ClassifierFreeGuidance(net, 2.0, num_classes=10, interval=(0.3, 5.0))),
    "routing": (["routing_guidance.scale=2", "routing_guidance.weak_ratio=0.75", "routing_guidance.strong_ratio=0.25"],
                lambda net: RoutingGuidance(net, weak_ratio=0.75, strong_ratio=0.25, scale=2.0)),
    "both": (["cfg_scale=1.5", "routing_guidance.scale=1.5"],
             lambda net: RoutingGuidance(ClassifierFreeGuidance(net, 1.5, num_classes=10), weak_ratio=0.7,
                                         strong_ratio=0.3, scale=1.5)),
}


@pytest.mark.parametrize("name", sorted(GUIDANCE))
def test_guidance_equals_generate_on_the_explicit_wrappers(cli_runs, newest, tmp_path, capsys, name):
    """sample.py's guidance options give exactly the images of `generate` on the wrapper built by hand (scale,
    ratios, interval and wrapping order all reach the sampler), and differ from the unguided ones."""
    out, _ = cli_runs
    options, wrap = GUIDANCE[name]
    ok(sample_here(capsys, f"ckpt={newest}", "num_samples=10", f"out={tmp_path}/g.npz", *options))
    ref, guided = load_npz(out / "ref.npz"), load_npz(tmp_path / "g.npz")
    net, _ = ckpt.load_sampling_net(newest)
    images, labels = generation.generate(wrap(net), range(10), decoder=IdentityDecoder(), progress=False,
                                         sampler_kwargs={"name": "edm", "num_steps": 6})
    np.testing.assert_array_equal(guided["arr_0"], images)
    np.testing.assert_array_equal(guided["arr_1"], labels)
    np.testing.assert_array_equal(guided["arr_1"], ref["arr_1"])  # labels come from the seeds
    assert not np.array_equal(guided["arr_0"], ref["arr_0"])


def test_seed_lists_keep_their_order_and_fixed_class(cli_runs, newest, tmp_path, capsys):
    out, _ = cli_runs
    ok(sample_here(capsys, f"ckpt={newest}", "seeds='7,3,8-9'", "batch_size=3", f"out={tmp_path}/a.npz"))
    ok(sample_here(capsys, f"ckpt={newest}", "seeds=[7,3,8,9]", "class_labels=5", f"out={tmp_path}/b.npz"))
    ref, a, b = load_npz(out / "ref.npz"), load_npz(tmp_path / "a.npz"), load_npz(tmp_path / "b.npz")
    np.testing.assert_array_equal(a["arr_0"], ref["arr_0"][[7, 3, 8, 9]])
    np.testing.assert_array_equal(a["arr_1"], ref["arr_1"][[7, 3, 8, 9]])
    assert b["arr_1"].tolist() == [5, 5, 5, 5]


# ----------------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2, nothing written

def _save_variant(state, path, edit):
    state = {**state, "config": {**state["config"]}}
    edit(state["config"])
    torch.save(state, path)
    return path


@pytest.fixture(scope="session")
def bad_cases(trained_run, newest, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    state = load_checkpoint(newest)
    no_drop = _save_variant(state, root / "no_drop.pt", lambda c: c.update(
        train={**c["train"], "general": {**c["train"]["general"], "class_drop_prob": 0.0}}))
    no_routes = _save_variant(state, root / "no_routes.pt", lambda c: c.update(
        model={**c["model"], "params": {**c["model"]["params"], "routes": [], "enable_routing": False}}))
    (root / "garbage.pt").write_bytes(b"this is not a checkpoint")
    data = newest.read_bytes()
    (root / "truncated.pt").write_bytes(data[:len(data) // 2])
    (root / "empty_run").mkdir()
    (root / "a_file").write_text("x")
    cases = {
        "missing": ([f"ckpt={root}/nothing.pt"], "does not exist"),
        "garbage": ([f"ckpt={root}/garbage.pt"], "cannot be read"),
        "truncated": ([f"ckpt={root}/truncated.pt"], "not a checkpoint of this project; pass another checkpoint file"),
        "no_ckpt_in_dir": ([f"ckpt={root}/empty_run"], "no checkpoint"),
        "zero_samples": ([f"ckpt={newest}", "num_samples=0"], "num_samples"),
        "bad_seeds": ([f"ckpt={newest}", "seeds=3-x"], "seeds"),
        "count_mismatch": ([f"ckpt={newest}", "seeds=0-4", "num_samples=3"], "does not match"),
        "cfg_without_dropout": ([f"ckpt={no_drop}", "cfg_scale=2"], "class_drop_prob"),
        "routing_without_routes": ([f"ckpt={no_routes}", "routing_guidance.scale=2"], "routes"),
        "out_dir_missing": ([f"ckpt={newest}", f"out={root}/no/such/dir/s.npz"], "does not exist"),
        "out_under_a_file": ([f"ckpt={newest}", f"out={root}/a_file/s.npz"], "not a directory"),
        "grid_dir_missing": ([f"ckpt={newest}", f"grid={root}/nodir/g.png"], "grid"),
        "unknown_sampler": ([f"ckpt={newest}", "sampler.name=rk4"], "unknown sampler"),
        "sampler_as_a_value": ([f"ckpt={newest}", "sampler=euler"], "sampler.name=euler"),
        "unknown_setting": ([f"ckpt={newest}", "+sampler.steps=3"], "steps"),
        "unknown_option": ([f"ckpt={newest}", "sampler.stepz=3"], "unknown config key sampler.stepz"),
        "unknown_flag": ([f"ckpt={newest}", "--vae", f"{root}/vae"], "vae=DIR"),
        "zero_batch": ([f"ckpt={newest}", "batch_size=0"], "batch_size"),
        "zero_grid_images": ([f"ckpt={newest}", "grid_images=0"], "grid_images"),
        "negative_class": ([f"ckpt={newest}", "class_labels=-1"], "class_labels"),
        "no_ckpt": ([], "ckpt is required"),
        "setting_of_other_sampler": ([f"ckpt={newest}", "sampler.solver=euler"], "solver"),
        "bad_class": ([f"ckpt={newest}", "class_labels=10"], "class_labels"),
    }
    return root, cases


BAD_CASES = ["missing", "garbage", "truncated", "no_ckpt_in_dir", "zero_samples", "bad_seeds", "count_mismatch",
             "cfg_without_dropout", "routing_without_routes", "out_dir_missing", "out_under_a_file",
             "grid_dir_missing", "unknown_sampler", "sampler_as_a_value", "unknown_setting", "unknown_option",
             "unknown_flag", "setting_of_other_sampler", "bad_class", "zero_batch", "zero_grid_images",
             "negative_class", "no_ckpt"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_and_writes_nothing(bad_cases, case, capsys):
    root, cases = bad_cases
    args, needle = cases[case]
    (root / case).mkdir()
    proc = sample_here(capsys, "num_samples=2", f"out={root / case}/s.npz", f"grid={root / case}/g.png", *args)
    assert_one_line_error(proc, needle)
    assert proc.returncode == 2
    assert list((root / case).iterdir()) == []


@pytest.mark.parametrize("case", sorted(SUBPROCESS_BAD_CASES))
def test_bad_input_from_the_command_line(cli_runs, case):
    out, results = cli_runs
    assert_one_line_error(results[case], SUBPROCESS_BAD_CASES[case][1])
    assert results[case].returncode == 2
    assert list((out / case).iterdir()) == []


# ----------------------------------------------------------------------------------------------------
# The importable core (what the in-training evaluation calls)

def test_parse_seeds():
    assert generation.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert generation.parse_seeds("0,5,7") == [0, 5, 7]
    assert generation.parse_seeds("0-2,20-21") == [0, 1, 2, 20, 21]
    assert generation.parse_seeds(3) == [3]
    assert generation.parse_seeds([4, "1-2"]) == [4, 1, 2]
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2", "1.5", "0-3,2", [-1], True):
        with pytest.raises(UserError, match="seeds"):
            generation.parse_seeds(bad)


def test_the_documented_seed_forms_are_values_the_command_line_takes():
    """The seed forms the configuration reference gives (from the schema) parse on Hydra's command line; a bare
    comma list would be a sweep."""
    import dataclasses
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from training.config_schema import SampleSchema

    doc = next(f for f in dataclasses.fields(SampleSchema) if f.name == "seeds").metadata["doc"]
    forms = re.match(r"e\.g\. (.*?) \(", doc).group(1).replace(" or ", ", ").split(", ")
    parser = OverridesParser.create()
    assert {tuple(generation.parse_seeds(parser.parse_override(f"seeds={form}").value())) for form in forms} == {
        tuple(range(50000)), (0, 5, 7), (*range(10), *range(20, 30))}
    assert parser.parse_override("seeds=0,5,7").is_sweep_override()  # "Ambiguous value" outside a sweep


def test_load_sampling_net_uses_the_ema_of_the_newest_checkpoint(trained_run, newest):
    net, cfg = ckpt.load_sampling_net(trained_run)
    state = load_checkpoint(newest)
    assert cfg == state["config"] and not net.training and net.sigma_data == cfg["diffuser"]["sigma_data"]
    own = net.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state["ema"].items())
    assert not all(torch.equal(own[k], v) for k, v in state["model"].items())
    older = load_checkpoint(list_checkpoints(trained_run / "checkpoints")[0][1])
    assert not all(torch.equal(own[k], v) for k, v in older["ema"].items())


def test_generate_on_an_in_memory_model(trained_run):
    net, cfg = ckpt.load_sampling_net(trained_run)
    kw = dict(sampler_kwargs={"name": "euler", "num_steps": 3}, decoder=IdentityDecoder(), progress=False)
    images, labels = generation.generate(net, [5, 1, 9], batch_size=2, **kw)
    assert images.shape == (3, 16, 16, 3) and images.dtype == np.uint8 and labels.dtype == np.int64
    net.model.train()  # e.g. a model mid-training: sampled in eval mode (no routing), mode restored
    again, _ = generation.generate(net, [5, 1, 9], batch_size=3, **kw)
    assert net.model.training
    np.testing.assert_array_equal(images, again)
    _, fixed = generation.generate(net, [5, 1, 9], batch_size=3, class_labels=[0, 1, 2], **kw)
    assert fixed.tolist() == [0, 1, 2]
    with pytest.raises(UserError, match="no setting"):
        generation.generate(net, [0], sampler_kwargs={"name": "edm", "steps": 3}, decoder=IdentityDecoder())
    with pytest.raises(AssertionError, match="class labels"):  # sample.py refuses it first, naming class_labels
        generation.generate(net, [0], class_labels=11, decoder=IdentityDecoder(), progress=False)


def test_build_guided_net(trained_run):
    net, _ = ckpt.load_sampling_net(trained_run)
    assert generation.build_guided_net(net, {}) is net
    assert generation.build_guided_net(net, {"cfg_scale": 1.0, "routing_guidance": {"scale": None}}) is net
    cfg = generation.build_guided_net(net, {"cfg_scale": 1.5, "guidance_interval": [0.3, 5]}, class_drop_prob=0.1)
    assert cfg.scale == 1.5 and cfg.interval == (0.3, 5.0)
    both = generation.build_guided_net(net, {"cfg_scale": 2, "routing_guidance": {"scale": 1.5}})
    assert both.net is not net and both.strong_ratio == 0.3 and both.weak_ratio == 0.7
    with pytest.raises(AssertionError, match="class dropout"):  # sample.py refuses it first (check_guidance_has_dropout)
        generation.build_guided_net(net, {"cfg_scale": 2}, class_drop_prob=0)
    with pytest.raises(AssertionError, match="guidance_interval"):  # sample.py refuses it first (check_sample_config)
        generation.build_guided_net(net, {"cfg_scale": 2, "guidance_interval": [5, 1]})


def test_check_output_path_and_atomic_writers(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_output_path(tmp_path / "nope" / "x.npz", ".npz", "out")
    with pytest.raises(UserError, match=r"\.npz"):
        check_output_path(tmp_path / "x.png", ".npz", "out")
    with pytest.raises(UserError, match="directory"):
        check_output_path(tmp_path / "d.npz", ".npz", "out") if (tmp_path / "d.npz").mkdir() is None else 0
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
    path = generation.save_samples_npz(tmp_path / "s.npz", images, [1, 2, 3, 4, 5])
    data = load_npz(path)
    assert data["arr_1"].dtype == np.int64 and np.array_equal(data["arr_0"], images)
    generation.save_image_grid(tmp_path / "g.png", images, max_images=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "g.png", "s.npz"]


def test_a_group_given_a_value_is_one_line_on_a_schema_base(tmp_path):
    """With the schema as the config's base (registered in Hydra's ConfigStore), Hydra itself refuses
    `sampler=euler`: the line names the setting that works, as without that base."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from training.config_check import hydra_error_line
    from training.config_schema import SampleSchema

    ConfigStore.instance().store(name="sample_schema_base_test", node=SampleSchema)
    (tmp_path / "s.yaml").write_text("defaults:\n  - sample_schema_base_test\n  - _self_\nckpt: x\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        with pytest.raises(HydraException) as info:
            compose("s", overrides=["sampler=euler", "sampler.num_steps=3"])
    line = hydra_error_line(info.value, SampleSchema)
    assert line.startswith("sampler=euler: sampler is a group of settings") and "e.g. sampler.name=euler" in line
