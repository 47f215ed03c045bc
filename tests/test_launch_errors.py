"""Under `accelerate launch`, a bad input's one line is the last thing the user reads.

One process (accelerate's simple launcher): with `-q` the launcher adds nothing after the child's line
(without it, accelerate's own CalledProcessError traceback follows). Several processes (torch.distributed.run):
the launcher's failure report ends with each process's error file, where every rank leaves the same line
(tread_utils.errors.exit_with)."""
import subprocess
import sys

import pytest

from conftest import REPO, once_per_session, subprocess_env
from test_sample_cli import free_port

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]
BAD = {  # command -> (its bad options, the start of its one line)
    "sample.py": (["ckpt=/no/such/ckpt.pt", "num_samples=2"], "error: checkpoint /no/such/ckpt.pt does not exist"),
    "train.py": (["train.max_steps=0"], "error: train.max_steps=0 is not allowed"),
}


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    def launch_all(folder):
        env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}
        procs = {}
        for script, (args, _) in BAD.items():
            for n in (1, 2):
                mode = ["--num_processes", "1"] if n == 1 else ["--multi_gpu", "--num_processes", "2",
                                                                 "--main_process_port", str(free_port())]
                procs[f"{script} {n}"] = subprocess.Popen([*LAUNCH, *mode, str(REPO / script), *args], cwd=REPO,
                                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                          text=True)
        return {key: (proc.wait(timeout=300), proc.communicate()[1]) for key, proc in procs.items()}

    done = once_per_session(tmp_path_factory, "launches", launch_all)
    return {(key.split()[0], int(key.split()[1])): tuple(value) for key, value in done.items()}


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("script", sorted(BAD))
def test_the_error_line_ends_the_output(launches, script, processes):
    code, stderr = launches[script, processes]
    line = BAD[script][1]
    assert code != 0, stderr[-3000:]
    text = [s.strip() for s in stderr.splitlines() if s.strip() and set(s.strip()) != {"="}]  # less the borders
    assert text[-1].startswith(line) or text[-1].startswith(f"traceback : {line}"), stderr[-3000:]
    if processes == 1:
        assert "Traceback" not in stderr and sum(s.startswith("error:") for s in text) == 1, stderr[-3000:]
