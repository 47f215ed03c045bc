"""The README's quick start as a newcomer runs it, with a bad value: its `accelerate config default` and its
`accelerate launch` line, in a fresh accelerate home. The one-line error is the last thing printed, with no
traceback after it, and accelerate lists no defaults it took (without the config it says `--num_processes` was
set to a value of 0 on a CPU)."""
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env

ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
BAD = ("train.max_steps=0", "error: train.max_steps=0 is not allowed")


def quick_start() -> list:
    """The quick start's accelerate commands, as words, comments dropped."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Quick start")
    begin = readme.index("```bash\n", start) + len("```bash\n")
    block = readme[begin:readme.index("\n```", begin)]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("accelerate ")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """stderr of the quick start's first training launch with a bad value, with and without the config step."""
    commands = quick_start()
    config = [c for c in commands if c[1] == "config"]
    (launch, *_) = [c for c in commands if c[1] == "launch" and "train.py" in c]
    out = {}
    for with_config in (True, False):
        home = tmp_path_factory.mktemp("hf_home")
        env = {**subprocess_env(), "HF_HOME": str(home), "CUDA_VISIBLE_DEVICES": ""}
        for step in config if with_config else []:
            subprocess.run([*ACCELERATE, *step[1:]], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
        proc = subprocess.run([*ACCELERATE, *launch[1:], BAD[0], f"results_dir={home / 'results'}"], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        out[with_config] = (proc.returncode, proc.stderr)
    return launch, out


def test_the_quick_start_writes_the_defaults_then_launches_quietly():
    commands = quick_start()
    assert [c[:3] for c in commands][:2] == [["accelerate", "config", "default"], ["accelerate", "launch", "-q"]]


def test_a_bad_value_ends_the_quick_starts_output(launched):
    launch, out = launched
    code, stderr = out[True]
    lines = [s for s in stderr.splitlines() if s.strip()]
    assert code != 0 and lines[-1].startswith(BAD[1]), stderr[-2000:]
    assert "Traceback" not in stderr and "CalledProcessError" not in stderr, stderr[-2000:]
    assert "num_processes" not in stderr and "--mixed_precision" not in stderr, stderr[-2000:]


def test_without_the_config_step_accelerate_lists_its_defaults(launched):
    """What the config step is for: the plain launch's warning, which the quick start spares a newcomer."""
    _, out = launched
    assert "`--num_processes` was set to a value of" in out[False][1]
