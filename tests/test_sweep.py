"""Sweep presets (configs/sweep/), the SLURM launcher preset and scripts/reproduce_digits.sh compose with
the project's configs; a preset really launches through Hydra's multirun."""
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from conftest import compose_cfg, expand, run_script, script_calls
from routing_module import resolve_routes

START, END, RATIO = (f"model.params.routes.0.{k}" for k in ("start_layer_idx", "end_layer_idx", "selection_ratio"))


def preset_jobs(name, *command_line):
    cfg = compose_cfg([f"+sweep={name}"])
    return cfg, expand([f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + list(command_line))


def values(jobs, key):
    return [next(o.split("=", 1)[1] for o in job if o.startswith(key + "=")) for job in jobs]


@pytest.mark.parametrize("name, depth, guideline", [("placement", 12, (2, 8)), ("placement_l", 24, (2, 20)),
                                                    ("placement_xl", 28, (2, 24))])
def test_placement_grids_are_valid_routes_scaled_to_depth(name, depth, guideline):
    _, jobs = preset_jobs(name)
    routes = {(int(s), int(e)) for s, e in zip(values(jobs, START), values(jobs, END))}
    assert len(routes) == len(jobs) >= 24
    for s, e in routes:  # the router's own validation: inside the model, start <= end
        resolve_routes([dict(start_layer_idx=s, end_layer_idx=e, selection_ratio=0.5)], depth)
    assert guideline in routes and max(e for _, e in routes) == depth - 1 and 0 in {s for s, _ in routes}
    assert min(e for _, e in routes) in (depth // 3, depth // 3 + 1)


def test_ratio_and_compare_presets():
    _, jobs = preset_jobs("ratio")
    assert [float(v) for v in values(jobs, RATIO)] == [0.0, 0.25, 0.5, 0.75]
    _, jobs = preset_jobs("compare")
    assert sorted(zip(values(jobs, "model"), values(jobs, "global_seed"))) == \
        [(m, str(s)) for m in ("dit", "tread") for s in range(3)]


@pytest.mark.parametrize("name", ["placement", "placement_l", "placement_xl", "ratio", "compare"])
def test_presets_keep_the_run_dir_names_of_the_plain_sweep(name):
    plain = compose_cfg([]).hydra.job.config.override_dirname.exclude_keys
    cfg, jobs = preset_jobs(name)
    assert set(cfg.hydra.job.config.override_dirname.exclude_keys) == set(plain) | {"sweep"}
    job = jobs[1]
    assert compose_cfg([f"+sweep={name}", *job]).hydra.job.override_dirname == \
        compose_cfg(job).hydra.job.override_dirname == ",".join(sorted(job))


def test_command_line_values_replace_a_presets_values():
    _, jobs = preset_jobs("placement", f"{START}=2", f"{END}=7,8")
    assert sorted(zip(values(jobs, START), values(jobs, END))) == [("2", "7"), ("2", "8")]


def test_a_preset_launches_one_run_dir_per_job(tmp_path):
    """A real `train.py -m +sweep=ratio`; train.max_steps=0 makes every job fail at once (no training)."""
    proc = run_script("train.py", "-m", "+sweep=ratio", "train.max_steps=0", f"results_dir={tmp_path}",
                      "run_name=dry", check=True)
    dirs = sorted(p.name for p in (tmp_path / "dry").iterdir() if p.is_dir())
    assert dirs == [f"{RATIO}={r}" for r in ("0", "0.25", "0.5", "0.75")], (dirs, proc.stderr[-2000:])
    for d in dirs:
        info = json.loads((tmp_path / "dry" / d / "status.json").read_text())
        assert info["status"] == "failed" and "max_steps" in info["error"]


@dataclass
class SlurmQueueConf:
    """hydra-submitit-launcher 1.2's `submitit_slurm` schema (hydra_plugins/hydra_submitit_launcher/config.py):
    field names and types, so the preset composes against it without the optional plugin installed."""
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    timeout_min: int = 60
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    tasks_per_node: int = 1
    mem_gb: Optional[int] = None
    nodes: int = 1
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False
    _target_: str = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    partition: Optional[str] = None
    qos: Optional[str] = None
    comment: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    gres: Optional[str] = None
    cpus_per_gpu: Optional[int] = None
    gpus_per_task: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    account: Optional[str] = None
    signal_delay_s: int = 120
    max_num_timeout: int = 0
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    array_parallelism: int = 256
    setup: Optional[List[str]] = None


def test_slurm_launcher_preset_composes():
    """configs/hydra/launcher/slurm.yaml over the plugin's schema (the plugin's own when installed, else the
    copy above): every field it sets exists with its type, and the values reach the composed launcher."""
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401  (registers its schema)
    except ImportError:
        ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm", node=SlurmQueueConf(),
                                     provider="tests (hydra-submitit-launcher 1.2 schema)")
    cfg = compose_cfg(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=60",
                       "+sweep=placement", "run_name=placement"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["partition"], launcher["timeout_min"], launcher["gpus_per_node"], launcher["tasks_per_node"]) \
        == ("gpu", 60, 1, 1)
    assert launcher["submitit_folder"] == "results/placement/.submitit/%j"
    assert (launcher["signal_delay_s"], launcher["max_num_timeout"], launcher["array_parallelism"]) == (300, 0, 64)


def test_reproduce_script_runs_the_documented_sweeps(tmp_path):
    """The script with a stand-in python that records each command; every job it would launch composes."""
    calls, proc = script_calls("scripts/reproduce_digits.sh", tmp_path, RESULTS="res", REPORT="rep")
    assert proc.returncode == 0, proc.stderr
    assert [c[0] for c in calls] == ["train.py", "train.py", "-m"]
    assert calls[2] == ["-m", "tools.report", "res/compare", "res/ratio", "--out", "rep"]
    runs = {}
    for call in calls[:2]:
        assert call[1] == "-m"
        for job in expand(call[2:]):
            cfg = compose_cfg(job)
            assert (cfg.train.max_steps, cfg.train.eval.eval_interval, cfg.train.eval.fid_num_samples) == (600, 150, 256)
            assert cfg.model.backbone_type == "DiT-D/4" and cfg.dataset.name == "digits"
            key = f"{cfg.results_dir}/{cfg.run_name}/{cfg.hydra.job.override_dirname}"
            routes = [(r.start_layer_idx, r.end_layer_idx, r.selection_ratio) for r in cfg.model.params.routes]
            runs[key] = (cfg.model.name, cfg.global_seed, routes if cfg.model.params.enable_routing else None)
    assert len(runs) == 8
    compare = sorted(v for k, v in runs.items() if k.startswith("res/compare/"))
    assert compare == sorted([("dit", s, None) for s in range(3)] + [("tread", s, [(2, 8, 0.5)]) for s in range(3)])
    ratio = sorted(v for k, v in runs.items() if k.startswith("res/ratio/"))
    assert ratio == [("tread", 0, [(2, 8, r)]) for r in (0.25, 0.75)]  # 0 and 0.5 are compare's seed-0 runs
