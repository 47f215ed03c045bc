"""The `imports` key: a selection rule and a fusion registered in the user's own file reach train.py (with its
in-training evaluation), sample.py (from the run's saved config) and its guidance; what cannot be imported, or a
name no module registered, is refused in one line that points at the key. And `import dit` alone, what such a
file starts with, loads no config machinery.

The user's files are written into a folder of their own, which the commands run from (the working directory is
on the import path), as docs/extensions.md's "Your own code" shows; its example is run here as written.
"""
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from dit import get_model
from conftest import REPO, assert_one_line_error, subprocess_env, tiny_overrides
from train_runs import records
from training.checkpoint import list_checkpoints
from tread_utils.errors import UserError
from tread_utils.user_imports import import_user_modules

DOCS = REPO / "docs" / "extensions.md"
# a tiny model, two steps, an in-training FID (digits scorer: 128 samples) at step 2
TINY_EVAL = ["train.max_steps=2", "train.ckpt_every=2", "train.logging.log_interval=1", "train.general.num_workers=0",
             "train.eval.eval_interval=2", "train.eval.fid_num_samples=128", "train.eval.batch_size=64",
             "train.eval.sampler.num_steps=2"]
TINY_SAMPLE = ["num_samples=4", "sampler.num_steps=2", "progress=false"]

GATED = '''
import torch, torch.nn as nn
import dit
from routing_module import Fusion
class Gated(nn.Module):
    def __init__(self, hidden_size, gate_init):
        super().__init__(); self.gate = nn.Parameter(torch.full((hidden_size,), gate_init))
    def forward(self, x_deep, x_shallow, keep_idx):  # keep_idx [B, K] always (K = N when no token was dropped)
        idx = keep_idx.unsqueeze(-1).expand(-1, -1, x_shallow.shape[-1])
        return x_shallow.scatter(1, idx, self.gate * x_deep + (1 - self.gate) * x_shallow.gather(1, idx))
def build_gated(hidden_size, route, *, gate_init: float = 1.0):
    return Gated(hidden_size, gate_init)
dit.FUSIONS["gated"] = Fusion(build=build_gated, flops=lambda hidden, tokens: 3 * tokens * hidden)
'''


def docs_example() -> tuple:
    """(the module, the commands) of docs/extensions.md's "Your own code": its python block and its console lines
    (not a bash block: tests/test_docs_commands.py checks those from the repository, where no user module is)."""
    section = DOCS.read_text().split("\n## Your own code\n")[1].split("\n## ")[0]
    module = re.search(r"```python\n(.*?)```", section, re.S)[1]
    commands = re.search(r"```console\n(.*?)```", section, re.S)[1]
    return module, [shlex.split(line, comments=True) for line in commands.splitlines() if line.strip()]


def command(argv: list, *extra) -> list:
    """A documented command line with the test's settings: an override in `extra` replaces the command's own."""
    keys = {arg.split("=")[0].lstrip("+") for arg in extra}
    return [*(a for a in argv if a.split("=")[0].lstrip("+") not in keys), *extra]


def run(cwd, script, *args, timeout=600):
    """`python SCRIPT ARGS` run from the user's folder `cwd` (a relative results_dir lands there)."""
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd, timeout=timeout,
                          env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def last_line(proc) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def rule_run(tmp_path_factory):
    """The docs' example: its module in the user's folder, its training command with a tiny in-training FID."""
    user = tmp_path_factory.mktemp("user_rule")
    module, (train, _) = docs_example()
    (user / "my_rules.py").write_text(module)
    assert train[:2] == ["python", "train.py"]
    ok(run(user, "train.py", *command(train[2:], *tiny_overrides("tread"), *TINY_EVAL)))
    name, = [a.split("=", 1)[1] for a in train if a.startswith("run_name=")]  # its own: not the quick start's run
    return user, user / "results" / name


def test_a_selection_rule_of_the_users_file_trains_evaluates_and_samples(rule_run):
    user, run_dir = rule_run
    assert "imports:\n- my_rules" in (run_dir / "config.yaml").read_text()  # saved with the run
    assert records(run_dir, "fid").keys() == {2}
    _, (_, sample) = docs_example()
    assert sample[:2] == ["python", "sample.py"]
    ok(run(user, "sample.py", *command(sample[2:], *TINY_SAMPLE, f"out={user / 'samples.npz'}")))
    with np.load(user / "samples.npz") as f:
        assert f["arr_0"].shape[0] == 4


def test_sampling_without_the_users_module_is_refused_in_one_line(rule_run, tmp_path):
    user, run_dir = rule_run
    elsewhere = run(tmp_path, "sample.py", f"ckpt={run_dir}", *TINY_SAMPLE, f"out={tmp_path / 's.npz'}")
    assert_one_line_error(elsewhere, "imports=[my_rules]", "no module my_rules", "saved with")
    unsaved = tmp_path / "no_imports.pt"  # a run trained without the key (by runpy, say): the rule is still named
    state = torch.load(list_checkpoints(run_dir / "checkpoints")[-1][1], weights_only=True)
    del state["config"]["imports"]
    torch.save(state, unsaved)
    none = run(user, "sample.py", f"ckpt={unsaved}", *TINY_SAMPLE, f"out={tmp_path / 's.npz'}")
    assert_one_line_error(none, "lowest_norm", "imports=[your_module]")
    assert not (tmp_path / "s.npz").exists()


def test_a_fusion_of_the_users_file_trains_evaluates_samples_and_guides(tmp_path):
    (tmp_path / "my_fusion.py").write_text(GATED)
    gated = ["imports=[my_fusion]", "model.params.routes.0.fusion=gated",
             "+model.params.routes.0.fusion_options.gate_init=0.5"]
    ok(run(tmp_path, "train.py", *tiny_overrides("tread"), *TINY_EVAL, *gated))
    run_dir = tmp_path / "results" / "tread-digits"
    assert records(run_dir, "fid").keys() == {2}
    gate = torch.load(list_checkpoints(run_dir / "checkpoints")[-1][1], weights_only=True)["ema"]["fusions.0.gate"]
    assert gate.shape == (32,)  # the user's module is the route's fusion, in the weights sampling loads strictly
    sampled = {name: run(tmp_path, "sample.py", f"ckpt={run_dir}", *TINY_SAMPLE, f"out={tmp_path / name}.npz", *extra)
               for name, extra in {"plain": [], "routing": ["routing_guidance.scale=1.5"],
                                   "path_drop": ["path_drop_guidance.scale=1.5"]}.items()}
    ok(sampled["plain"])
    ok(sampled["routing"])
    assert "path-drop" in last_line(sampled["path_drop"]).lower()
    assert not (tmp_path / "path_drop.npz").exists()


def test_training_refuses_a_module_it_cannot_import_and_a_name_no_module_registered(tmp_path):
    (tmp_path / "broken.py").write_text("import routing_module\nroutng_module.SELECTIONS['x'] = None\n")
    cases = {"imports=[nowhere]": ("imports=[nowhere]", "no module nowhere", str(tmp_path)),
             "imports=[rules/my_rules.py]": ("imports=[rules/my_rules.py]", "imports=[my_rules]"),
             "imports=[broken]": ("imports=[broken]", "NameError", "broken.py, line 2"),
             "model.params.routes.0.selection=lowest_norm": ("lowest_norm", "imports=[your_module]")}
    for override, needles in cases.items():
        proc = run(tmp_path, "train.py", f"results_dir={tmp_path / 'results'}", *tiny_overrides("tread"), override)
        assert_one_line_error(proc, *needles)
    assert not (tmp_path / "results").exists()  # refused before anything was written


def test_a_block_type_no_module_registered_points_at_imports():
    """Where a run's model is built (sample.py, the route probe, a Python caller): train.py's check refuses the name
    first, by the schema's rule, without the hint."""
    with pytest.raises(UserError, match=re.escape("got 'mine' (one registered in a module of yours: imports=[")):
        get_model("DiT-D/4", {"num_classes": 10, "in_channels": 1, "input_size": 16, "block_type": "mine"})


def test_an_imported_module_runs_once(tmp_path, monkeypatch):
    (tmp_path / "counted_rules.py").write_text("import builtins\nbuiltins.counted_imports = "
                                               "getattr(builtins, 'counted_imports', 0) + 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    import builtins

    assert import_user_modules(["counted_rules"]) == ["counted_rules"]
    assert import_user_modules(["counted_rules"]) == ["counted_rules"]
    assert builtins.counted_imports == 1
    del builtins.counted_imports, sys.modules["counted_rules"]


def test_importing_dit_loads_neither_omegaconf_nor_hydra():
    """A user's module starts with `import dit`: the model code needs no config machinery (a fresh interpreter:
    the suite's prewarmed ones have both loaded)."""
    code = "import sys, dit; print(sorted({m.split('.')[0] for m in sys.modules} & {'omegaconf', 'hydra'}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**subprocess_env(), "TREAD_TESTS_FRESH": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
