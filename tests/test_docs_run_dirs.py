"""Every documented training command runs after the README's quick start: one that lands in a quick-start run's
directory (results/tread-digits, results/dit-digits) resumes that run, so it must be that run's configuration, but
for its cap (train.max_steps) and the keys that do not change what a run trains (tools/configurations.py's
NOT_CONFIGURATION: logging, checkpoint retention, ...). Any other configuration needs a run_name of its own, or it
is refused as a checkpoint of another model, or trains on from the quick start's weights."""
import pytest
from accelerate.commands.launch import launch_command_parser
from hydra._internal.utils import get_args_parser
from omegaconf import OmegaConf

from test_docs_commands import (ASSIGNMENT, COMMANDS, REPO, CommandError, compose_checked, launcher_overrides, quiet,
                                segments, tokens)
from tools.configurations import NOT_CONFIGURATION, flat_config


def train_arguments(text: str) -> list:
    """The train.py arguments of each simple command of a shell line that runs train.py."""
    found = []
    for words in segments(tokens(text)):
        while words and ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words[:2] == ["accelerate", "launch"]:
            opts = quiet(launch_command_parser().parse_args, words[2:])
            if opts.training_script.endswith("train.py"):
                found.append(opts.training_script_args)
        elif words[:1] in (["python"], ["python3"]) and words[1:2] == ["train.py"]:
            found.append(words[2:])
    return found


def single_runs():
    """(command, its overrides) of each documented train.py command that is one run (no sweep, no --cfg)."""
    found = []
    for command in COMMANDS:
        try:
            for args in train_arguments(command.text):
                hydra_args = quiet(get_args_parser().parse_args, args)
                if not hydra_args.multirun and not hydra_args.cfg:
                    found.append((command, tuple(launcher_overrides(hydra_args.overrides))))
        except CommandError:
            continue  # a command that does not parse: tests/test_docs_commands.py reports it
    return found


def run_of(overrides):
    """(run directory, {key: value} of the configuration it trains)."""
    try:
        cfg = compose_checked("config", overrides)
    except CommandError:
        return None, {}  # tests/test_docs_commands.py reports it
    cfg = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    config = {k: v for k, v in flat_config(cfg).items()
              if not NOT_CONFIGURATION.fullmatch(k) and k != "train.max_steps"}
    return f"{cfg['results_dir']}/{cfg['run_name']}", config


RUNS = single_runs()


def quick_start_runs() -> dict:
    """{run directory: configuration} of the training commands in the README's quick start section."""
    text = (REPO / "README.md").read_text()
    start = text.index("## Quick start")
    first, last = text.count("\n", 0, start) + 1, text.count("\n", 0, text.index("\n## ", start)) + 1
    return dict(run_of(o) for c, o in RUNS if c.doc == "README.md" and first <= c.line <= last)


def test_the_quick_start_trains_tread_and_dit_runs():
    assert {"results/tread-digits", "results/dit-digits"} <= set(quick_start_runs())


@pytest.mark.parametrize("command, overrides", RUNS, ids=[f"{c.doc}:{c.line}" for c, _ in RUNS])
def test_a_documented_run_in_a_quick_start_directory_is_that_run(command, overrides):
    quick = quick_start_runs()
    where, config = run_of(overrides)
    if where not in quick:
        return
    differs = sorted(k for k in set(config) | set(quick[where]) if config.get(k) != quick[where].get(k))
    assert not differs, (f"{command} trains into {where}, the quick start's run, another configuration "
                         f"({', '.join(differs[:4])}): give it a run_name of its own")


def test_the_check_sees_a_collision():
    """The LightningDiT command as it was printed: the quick start's directory, another model."""
    quick = quick_start_runs()
    where, config = run_of(("model=tread", "model.backbone_type=LightningDiT-D/4"))
    assert where == "results/tread-digits" and config != quick[where]
