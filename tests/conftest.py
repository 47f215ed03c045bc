import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import filelock
import prewarmed
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import training.config_schema  # noqa: F401  (stores the schema, the configs' base, in Hydra's ConfigStore)


def pin_xdist_worker():
    """Under pytest-xdist, each worker and everything it starts runs on a core of its own, with one thread:
    torch's threads on shared cores spin against each other and a run takes many times as long."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count < 2 or len(cores) < 2:
        return
    index = int(worker.removeprefix("gw"))
    share = max(1, len(cores) // count)
    os.sched_setaffinity(0, cores[(index * share) % len(cores):][:share])
    import torch

    torch.set_num_threads(share)


pin_xdist_worker()
prewarmed.install()  # the suite's `python` subprocesses start without re-importing torch (tests/prewarmed.py)

# A small model so subprocess training runs take seconds: 4 blocks, 32 wide, route 1 -> 2.
TINY_MODEL = ["+model.params.depth=4", "+model.params.hidden_size=32", "+model.params.num_heads=2"]
TINY_ROUTE = ["model.params.routes.0.start_layer_idx=1", "model.params.routes.0.end_layer_idx=2"]
TINY_TRAIN = ["train.general.batch_size=16", "train.eval.eval_interval=0", "train.logging.tensorboard=false"]


def tiny_overrides(model="tread"):
    return [f"model={model}", *TINY_MODEL, *(TINY_ROUTE if model == "tread" else []), *TINY_TRAIN]


def subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(script) -> list:
    """A root script by file name (`train.py`), or a packaged tool by module name (`lab.bench`)."""
    return [str(REPO / script)] if script.endswith(".py") else ["-m", script]


def run_script(script, *args, timeout=300, check=False):
    proc = subprocess.run([sys.executable, *command(script), *map(str, args)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def expand(sweeps):
    """Hydra's basic sweeper: the cartesian product of every `key=a,b,range(..)` override, later keys win."""
    parsed = {}
    for o in OverridesParser.create().parse_overrides(list(sweeps)):
        key = o.get_key_element()
        parsed[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                       else [f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*parsed.values())]


def script_calls(script, tmp_path, **env):
    """Run a shell script with a stand-in python that records its arguments: one list per command, and the
    finished process (the script must not need the real interpreter)."""
    log, fake = tmp_path / "calls", tmp_path / "fake-python"
    # one locked append per call: scripts that run jobs in parallel must not interleave their records
    fake.write_text(f'#!/usr/bin/env bash\nexec 9>> {log}\nflock 9\nprintf "%s\\n" "$@" --- >&9\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / script)], env={**subprocess_env(), "PYTHON": str(fake), **env},
                          capture_output=True, text=True, timeout=60)
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()] if log.exists() else []
    return calls, proc


def once_per_session(tmp_path_factory, name, make):
    """`make(folder)` run once per test session, by whichever pytest-xdist worker asks first: the others wait and get
    its (JSON) result and folder. Under xdist each worker runs a session fixture of its own, and the suite's costliest
    fixtures (many commands run) must not run twice."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / name  # the session's folder, above each worker's own
    with filelock.FileLock(f"{shared}.lock"):
        done = shared / "result.json"
        if done.is_file():
            return json.loads(done.read_text())
        shared.mkdir(exist_ok=True)
        result = make(shared)
        done.write_text(json.dumps(result))
        return result


def completed(result) -> subprocess.CompletedProcess:
    """A finished process as once_per_session passes it on ([args, returncode, stdout, stderr])."""
    return subprocess.CompletedProcess(*result)


def assert_one_line_error(proc, *needles):
    """Bad input: non-zero exit, no traceback, one `error:` line on stderr that names the problem."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle.lower() in errors[0].lower(), errors[0]
    return errors[0]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process state per interpreter: a test that builds an Accelerator in-process
    (cpu=True here, CUDA on a GPU machine) must not decide the device of the next one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def run_forked_ranks(target, *args, world: int = 2, timeout: float = 120):
    """`target(rank, *args)` in `world` processes forked from this one (nothing re-imported: they start at once);
    each must exit 0."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0] * world


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """An uninterrupted 2-process (DDP) run of 8 steps, evaluated at steps 4 and 8 (train_runs.run_args): the
    resume tests' reference, and the FSDP2 tests' too."""
    from train_runs import run_args, run_train

    def make(root):
        run_train(*run_args(root, "two"), processes=2)
        return str(root / "two")

    return Path(once_per_session(tmp_path_factory, "straight", make))


@pytest.fixture
def repo():
    return REPO


def save_tiny_vae(path, sample_size):
    """A tiny randomly initialised diffusers AutoencoderKL (downsamples by 2), saved so real loading code runs."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
                        norm_num_groups=8, sample_size=sample_size)
    vae.save_pretrained(path)
    return str(path)


def projection_extractor(dims: dict, offset: float = 0.0, gain: float = 1.0):
    """A fast stand-in with the feature extractor interface: a fixed random projection (seed 0) of 4x4-pooled
    pixels, ``(pixels / 255 - offset) @ proj * gain``, split into ``dims`` ({'pool': 12, ...}) in that order."""
    import torch

    class ProjectionExtractor(torch.nn.Module):
        feature_dims = dict(dims)

        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.proj = torch.nn.Parameter(torch.randn(48, sum(dims.values()), generator=g), requires_grad=False)

        def forward(self, images):
            x = images.float().permute(0, 3, 1, 2) / 255 - offset
            x = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1) @ self.proj * gain
            return dict(zip(dims, x.split(list(dims.values()), dim=1)))

    return ProjectionExtractor()
