"""The config schema and its validation pass: bad values through the real command line (one line, exit 2,
the results directory untouched), every shipped config accepted, the generated reference (docs/configuration.md)
and the registries the schema names kept in step with it, each default in one place."""
import dataclasses
import re
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from conftest import REPO, assert_one_line_error, completed, once_per_session, subprocess_env
from training import config_schema as S
from training.config_check import check_train_config, conform, hydra_error_line, schema_at, schema_keys
from tread_utils.errors import UserError

# case -> (overrides of the default digits config, words the error line must name)
BAD = {
    "batch_size_zero": (["train.general.batch_size=0"], "train.general.batch_size=0"),
    "negative_lr": (["train.optimizer.lr=-1"], "train.optimizer.lr"),
    "ema_decay_above_one": (["train.ema.decay=1.5"], "train.ema.decay=1.5"),
    "fid_below_feature_dims": (["train.eval.fid_num_samples=10"], "at least 128"),
    "fid_below_inception_dims": (["dataset=imagenet256", "dataset.train_path=/", "train.eval.ref_batch=/",
                                  "train.eval.fid_num_samples=1000"], "at least 2048"),
    "batch_not_divisible_by_accum": (["train.general.batch_size=63", "train.general.grad_accum_steps=2"],
                                     "divisible"),
    "class_drop_one": (["train.general.class_drop_prob=1"], "class_drop_prob"),
    "zero_log_interval": (["train.logging.log_interval=0"], "log_interval"),
    "zero_sampler_steps": (["train.eval.sampler.num_steps=0"], "num_steps"),
    "sigma_min_above_max": (["+train.eval.sampler.sigma_min=80", "+train.eval.sampler.sigma_max=1"], "sigma_min"),
    "unknown_precision": (["train.mixed_precision=fp8"], "mixed_precision"),
    "missing_dataset_path": (["dataset=imagenet256", "dataset.train_path=/does/not/exist"], "/does/not/exist"),
    "lr_not_a_number": (["train.optimizer.lr=abc"], "train.optimizer.lr: Value 'abc' of type 'str' could not be converted"),
    "unknown_key_hydra": (["train.foo=1"], "unknown config key train.foo"),
    "unknown_key_schema": (["+train.general.foo=1"], "unknown config key train.general.foo"),
    "unknown_route_key": (["+model.params.routes.0.foo=1"], "unknown config key model.params.routes.0.foo"),
    "unknown_route_key_hydra": (["model.params.routes.0.foo=1"], "unknown config key model.params.routes.0.foo"),
    "route_ratio_not_a_number": (["model.params.routes.0.selection_ratio=abc"],
                                 "model.params.routes.0.selection_ratio: Value 'abc'"),
    "unknown_key_in_a_route_list": (["model.params.routes=[{start_layer_idx:1,end_layer_idx:2,selection_ratio:0.5,x:1}]"],
                                    "unknown config key model.params.routes.x"),
    "beta_of_one": (["train.optimizer.betas=[0.9,1.0]"], "betas"),
    "learn_sigma": (["model.params.learn_sigma=true"], "learn_sigma"),
    "unknown_init": (["model.params.init=xavier"], "model.params.init"),
    "negative_cfg_scale": (["train.eval.cfg_scales=[-1]"], "cfg_scales"),
    "flag_given_a_number": (["train.eval.smoke=2"], "train.eval.smoke=2 must be true or false"),
    "unknown_compile_scope": (["train.compile_scope=layers"], "train.compile_scope=layers is not allowed"),
}


def snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="session")
def refused(tmp_path_factory):
    """Every BAD case through `python train.py`, two at a time, against a results dir holding a run."""
    def launch_all(folder):
        results = folder / "results"
        run = results / "tread-digits"
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "ckpt_00000200.pt").write_bytes(b"a checkpoint")
        (run / "metrics.jsonl").write_text('{"step": 200, "loss": 0.5}\n')
        before = snapshot(results)

        def launch(overrides):
            proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"results_dir={results}", *overrides],
                                  cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
            return [proc.args, proc.returncode, proc.stdout, proc.stderr]

        with ThreadPoolExecutor(2) as pool:
            procs = dict(zip(BAD, pool.map(launch, [overrides for overrides, _ in BAD.values()])))
        return procs, snapshot(results) == before

    procs, untouched = once_per_session(tmp_path_factory, "refused", launch_all)
    return {case: completed(proc) for case, proc in procs.items()}, untouched


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_value_is_refused_in_one_line_before_anything_runs(refused, case):
    procs, untouched = refused
    assert_one_line_error(procs[case], BAD[case][1])
    assert procs[case].returncode == 2
    assert untouched, "a refused launch wrote to the results directory"


def test_the_table_has_at_least_twenty_bad_values(refused):
    """Twenty or more cases, each a bad value of its own: refused with exit 2 and a line no other case gives."""
    procs, _ = refused
    lines = {case: [s for s in proc.stderr.splitlines() if s.startswith("error:")] for case, proc in procs.items()}
    refusals = {case: found[0] for case, found in lines.items() if procs[case].returncode == 2 and len(found) == 1}
    assert len(set(refusals.values())) >= 20, sorted(set(BAD) - set(refusals))


def compose_train(*overrides):
    """The composed config; a refusal while composing (the schema is the base) as train.py words it."""
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    except HydraException as e:
        raise UserError(hydra_error_line(e)) from None


@pytest.mark.parametrize("overrides", [[], ["model=dit", "diffuser=rf"],
                                       ["dataset=imagenet256", "dataset.train_path=/", "train.eval.eval_interval=0"]])
def test_shipped_configs_pass(overrides):
    merged = check_train_config(compose_train(*overrides), world_size=1).config
    assert merged.model.params.init == "official" and merged.train.general.grad_accum_steps == 1


@pytest.mark.parametrize("overrides, needle", [
    (["train.ckpt_every=0"], "train.ckpt_every=0"),
    (["diffuser.P_std=0"], "P_std"),
    (["train.eval.eval_interval=-1"], "eval_interval"),
    (["train.compile=maybe"], "train.compile"),
    (["train.optimizer.grad_clip=-1"], "grad_clip"),
    (["train.eval.batch_size=0"], "train.eval.batch_size=0"),
    (["train.cpu_threads=0"], "train.cpu_threads"),
    (["train.dist_timeout_minutes=0"], "dist_timeout_minutes"),
    (["lock_stale_minutes=0"], "lock_stale_minutes"),
    (["model.params.cond_mode=film"], "cond_mode"),
    (["model.params.routes.0.selection=best"], "selection"),
    (["model.params.routes.0.end_layer_idx=40"], "end_layer_idx=40"),
    (["train.eval.sampler.name=rk4"], "unknown sampler"),
    (["dataset=imagenet256", "dataset.train_path=/"], "ref_batch"),
    (["init_from=/does/not/exist"], "init_from"),
    (["init_from_weights=model"], "init_from_weights=model is not allowed: it must be one of model_and_ema, ema"),
    (["dataset.random_flip=true"], "dataset.kind=shards only"),
])
def test_more_rules_in_process(overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        check_train_config(compose_train(*overrides), world_size=1)


def test_batch_must_divide_over_processes():
    with pytest.raises(UserError, match="divisible by processes"):
        check_train_config(compose_train(), world_size=3)


def test_sample_yaml_and_sweep_presets_follow_the_schema():
    sample = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "sample.yaml"))
    assert sample.pop("defaults")[:2] == ["base_sample", "_self_"]
    sample.pop("hydra")  # Hydra's own keys, not the command's options
    conform(S.SampleSchema, sample)  # no unknown key, every type right
    assert set(schema_keys(S.SampleSchema)) == set(leaf_keys(sample))
    for preset in (REPO / "configs" / "sweep").glob("*.yaml"):
        for swept in OmegaConf.load(preset).hydra.sweeper.params:
            path = re.sub(r"\.\d+\.", ".", swept)
            parent, _, name = path.rpartition(".")
            assert swept in ("model", "global_seed") or name in schema_at(S.ConfigSchema, parent).__dataclass_fields__


def leaf_keys(node, prefix=""):
    for k, v in node.items():
        yield from leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]


def test_configuration_reference_is_generated():
    from tools import config_doc

    assert (REPO / "docs" / "configuration.md").read_text() == config_doc.render(), \
        "docs/configuration.md is stale: run python -m tools.config_doc"


# the YAML files every composition starts from: a value they set is the default, so the schema has none
BASE_YAML = {"config.yaml": "", "model/dit.yaml": "model.", "diffuser/edm.yaml": "diffuser.",
             "diffuser/rf.yaml": "diffuser.", "sample.yaml": ""}


@pytest.mark.parametrize("name, prefix", sorted(BASE_YAML.items()))
def test_a_default_lives_in_one_place(name, prefix):
    """A key the base YAML sets has no default in the schema (None, "decided elsewhere", aside)."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / name))
    raw.pop("defaults"), raw.pop("hydra", None)
    schema = S.SampleSchema if name == "sample.yaml" else S.ConfigSchema
    defaults = OmegaConf.structured(schema)
    both = [prefix + k for k in leaf_keys(raw) if not OmegaConf.is_missing(defaults, prefix + k)
            and OmegaConf.select(defaults, prefix + k) is not None]
    assert both == [], f"set in configs/{name} and defaulted in the schema"


def test_sample_guidance_is_checked_at_the_entry_point():
    from training.config_check import check_sample_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        bad = compose("sample", overrides=["ckpt=x", "guidance_interval=[5,1]"])
        good = compose("sample", overrides=["ckpt=x", "guidance_interval=[0.3,5]"])
        ratio = compose("sample", overrides=["ckpt=x", "routing_guidance.weak_ratio=1"])
    with pytest.raises(UserError, match=re.escape("guidance_interval=[5.0, 1.0] is not allowed")):
        check_sample_config(bad)
    with pytest.raises(UserError, match=re.escape("routing_guidance.weak_ratio=1.0 is not allowed")):
        check_sample_config(ratio)
    assert list(check_sample_config(good).guidance_interval) == [0.3, 5.0]


def test_names_the_schema_allows_are_the_registries(monkeypatch):
    """The schema keeps no copy of a registry's names: its rule reads the registry, so a name added there is
    accepted and documented at once."""
    import data
    from evaluations import digits_classifier, inception

    assert S.SCORER_FEATURE_DIMS == {"digits": digits_classifier.POOL_DIM, "shards": inception.POOL_DIM}
    kind = next(f for f in dataclasses.fields(S.DatasetSchema) if f.name == "kind").metadata["rule"]
    assert not kind.ok("folder") and kind.allowed == "one of digits, shards"
    monkeypatch.setitem(data.DATASETS, "folder", data.DATASETS["digits"])
    assert kind.ok("folder") and kind.allowed == "one of digits, shards, folder"


def test_the_routes_node_is_the_route_itself():
    """model.params.routes is typed by tread_utils.route_spec.Route, no copy: the command line's keys land on its fields, a
    misspelt one is refused while composing, and the composed routes become `Route`s that checked themselves."""
    from tread_utils.route_spec import Route, RouteError

    cfg = compose_train("model=tread", "model.params.routes.0.selection=importance",
                        "model.params.routes.0.importance_mix=0.3", "model.params.routes.0.end_layer_idx=-2",
                        "model.params.routes.0.schedule.kind=linear", "model.params.routes.0.schedule.end_ratio=0.25",
                        "model.params.routes.0.schedule.end_step=10")
    route, = OmegaConf.to_object(cfg.model.params.routes)
    assert isinstance(route, Route) and S.ModelParamsSchema.__dataclass_fields__["routes"].type == typing.List[Route]
    assert (route.selection, route.options, route.importance_mix) == ("importance", {"importance_mix": 0.3}, None)
    from routing_module import resolve_routes  # torch: not at the top (a test imports this file to check without it)

    assert resolve_routes([route], 12)[0].end_layer_idx == 10 and route.ratio_at(10) == 0.25
    with pytest.raises(UserError, match="selection_ratioo"):
        compose_train("model=tread", "model.params.routes.0.selection_ratioo=0.3")
    bad = compose_train("model=tread", "model.params.routes.0.fusion=spring")  # a name the model's registry lacks
    with pytest.raises(RouteError, match="fusion must be one of none, sprint.*, got 'spring'"):
        check_train_config(bad)


def test_a_route_checks_itself_when_built_and_stays_as_built():
    from routing_module import resolve_routes
    from tread_utils.route_spec import Route, RouteError, Schedule

    for kwargs, message in ((dict(selection_ratio=1.5), r"selection_ratio must be in \[0, 1\)"),
                            (dict(schedule=dict(kind="linear", end_ratio=0.2)), "needs a float end_ratio and an "
                             "integer end_step"),
                            (dict(fusion_options=[0.1]), "fusion_options a mapping")):
        with pytest.raises(RouteError, match=message):
            Route(**{**dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5), **kwargs})
    route = Route(2, -1, 0.5, schedule=dict(kind="cosine", end_ratio=0.0, end_step=4))
    assert isinstance(route.schedule, Schedule) and route.ratio_at(2) == pytest.approx(0.25)
    with pytest.raises(dataclasses.FrozenInstanceError):
        route.selection_ratio = 0.7
    with pytest.raises(RouteError, match="outside a model of depth 4"):
        resolve_routes([Route(2, 5, 0.5)], 4)


def test_a_bad_plain_value_is_refused_before_torch_is_imported():
    """The rules that read a registry (which imports torch) run after every other rule: a refusal of a plain value
    answers in a fraction of a second, as a command-line user and the refusal tests above expect."""
    code = ("import sys; from test_config_schema import compose_train; from training.config_check import "
            "check_train_config\nfrom tread_utils.errors import UserError\n"
            "try:\n    check_train_config(compose_train('train.ckpt_every=0'))\n"
            "except UserError as e:\n    print('refused:', e)\n"
            "print('torch loaded:', 'torch' in sys.modules)")
    fresh = {**subprocess_env(), "TREAD_TESTS_FRESH": "1"}  # a fresh interpreter, not a prewarmed one (prewarmed.py)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", env=fresh, capture_output=True, text=True,
                          timeout=120)
    assert "refused: train.ckpt_every=0" in proc.stdout, proc.stdout + proc.stderr
    assert "torch loaded: False" in proc.stdout
