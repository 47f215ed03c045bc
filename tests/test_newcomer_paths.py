"""What a newcomer following the README and docs runs into: the extra the LoRA example needs, named where it is run
and by the tool itself when missing; pip extras written so that every shell takes them; the LoRA example's output
kept off the committed record; and a capped quick-start run that ends with digits, not noise."""
import json
import re
import subprocess
import sys

from conftest import REPO, subprocess_env
from test_docs_commands import COMMANDS, OUTPUT, tokens

LORA = "tools.finetune_lora"
EXTRA = re.compile(r"pip install (?P<flags>(?:-\S+ )*)(?P<target>\S*\.\[[\w,]+\]\S*)")


def test_the_lora_tool_without_peft_refuses_in_one_line_naming_the_extra():
    hide_peft = ("import runpy, sys; sys.modules['peft'] = None; sys.argv = ['finetune_lora', '--steps', '1']; "
                 f"runpy.run_module('{LORA}', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide_peft], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error:") and 'pip install -e ".[lora]"' in lines[0] and len(lines[0]) < 200


def test_each_doc_that_runs_the_lora_example_installs_its_extra_first():
    runs = [c for c in COMMANDS if not c.inline and LORA in c.text]
    assert {c.doc for c in runs} >= {"README.md", "docs/diffusers.md"}
    for command in runs:
        installs = [c for c in COMMANDS if c.doc == command.doc and c.line <= command.line
                    and 'pip install -e ".[lora]"' in c.text]
        assert installs, f"{command}: no `pip install -e \".[lora]\"` before it in {command.doc}"


def test_pip_extras_are_quoted_and_editable():
    """zsh reads an unquoted `.[lora]` as a glob and fails; a checkout is installed editable, as the README does."""
    written = [(c, m) for c in COMMANDS for m in EXTRA.finditer(c.text)]
    assert len(written) >= 3, written
    for command, match in written:
        assert match["target"].startswith('"') and match["target"].endswith('"'), command
        assert "-e" in match["flags"].split(), command


def test_the_lora_examples_write_nowhere_git_tracks():
    """docs/perf/finetune_lora_digits.log is the committed record: the examples write their own log elsewhere."""
    outputs = {path for c in COMMANDS if LORA in c.text for path in OUTPUT.findall(c.text)}
    outputs |= {w.split("=", 1)[1] for c in COMMANDS if LORA in c.text for w in tokens(c.text) if w.startswith("--out=")}
    assert outputs, "no LoRA example names its output"
    for path in outputs:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO, capture_output=True)
        assert tracked.returncode != 0, f"a documented LoRA command writes over the committed {path}"


def test_a_capped_quick_start_run_ends_at_an_evaluation_with_digits():
    """The quick start's capped run stops no earlier than the preset's first evaluation, where the committed default
    run already draws digits the classifier reads (class_acc well above chance, 0.1)."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start"))]
    caps = [int(c) for c in re.findall(r"train\.max_steps=(\d+)", quick)]
    assert caps
    records = [json.loads(line) for line in (REPO / "docs/perf/default_tread_digits_metrics.jsonl").read_text().splitlines()]
    evaluations = {r["step"]: r["class_acc"] for r in records if "class_acc" in r}
    for cap in caps:
        reached = [step for step in evaluations if step <= cap]
        assert reached, f"a run capped at {cap} ends before the first evaluation ({min(evaluations)}): a noise grid"
        assert evaluations[max(reached)] >= 0.5, (cap, evaluations)
