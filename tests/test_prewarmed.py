"""The suite's prewarmed subprocesses (tests/prewarmed.py) behave as fresh interpreters: the same argv, __main__,
sys.path[0], working directory, environment, streams and exit status, for `-c`, `-m` and a script."""
import os
import signal
import subprocess
import sys
import time

import pytest

import prewarmed
from conftest import REPO, subprocess_env

PROBE = ("import os, sys; print(sys.argv, __name__, sys.path[0], os.getcwd(), os.environ.get('HOME'), "
         "sys.stdin.read()); print('to stderr', file=sys.stderr); sys.exit(3)")


def fresh_and_prewarmed(args, **kwargs):
    """The same command through the original Popen (a fresh interpreter) and through the prewarmed server."""
    env = {**subprocess_env(), "HOME": "/elsewhere"}  # a variable no preloaded library reads: still served
    runs = []
    for popen in (subprocess._ORIGINAL_POPEN, prewarmed.PrewarmedPopen):
        with popen([sys.executable, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True, **kwargs) as proc:
            out, err = proc.communicate("input", timeout=120)
            runs.append((proc.returncode, out, err, proc._conn is not None if popen is prewarmed.PrewarmedPopen else None))
    return runs


@pytest.fixture(autouse=True)
def installed():
    if not hasattr(subprocess, "_ORIGINAL_POPEN"):
        pytest.skip("the prewarmed server is off (TREAD_TESTS_FRESH=1)")


def test_code_module_and_script_run_as_in_a_fresh_interpreter(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for args in (["-c", PROBE, "a", "b"], [str(script), "a"]):
        (code, out, err, _), (code2, out2, err2, served) = fresh_and_prewarmed(args, cwd=tmp_path)
        assert served, "the command did not go through the server"
        assert (code, out, err) == (code2, out2, err2) == (3, out, "to stderr\n")
    (code, out, err, _), (code2, out2, err2, served) = fresh_and_prewarmed(["-m", "tools.config_doc", "--help"],
                                                                          cwd=REPO)
    assert served and (code, out, err) == (code2, out2, err2) and code == 0 and "usage" in out


def test_an_environment_the_imports_read_differently_starts_a_fresh_process():
    for changed, served in ((("OMP_NUM_THREADS", "3"), False), (("TREAD_TESTS_FRESH", "1"), False),
                            (("PROBE_VALUE", "1"), True)):
        env = {**subprocess_env(), changed[0]: changed[1]}
        with subprocess.Popen([sys.executable, "-c", f"import os; print(os.environ[{changed[0]!r}])"], env=env,
                              stdout=subprocess.PIPE, text=True) as proc:
            assert proc.communicate(timeout=120)[0] == changed[1] + "\n"
            assert proc.returncode == 0 and (proc._conn is not None) == served, changed


def test_signals_reach_the_command_and_its_status_comes_back():
    with subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                          env=subprocess_env(), stdout=subprocess.PIPE, text=True) as proc:
        assert proc._conn is not None and proc.stdout.readline() == "up\n"
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", "import time; time.sleep(60)"], env=subprocess_env(), timeout=1)
    assert time.monotonic() - start < 30
