"""Every complete Python example in README.md and docs/ runs as written. A complete example is a block fenced
```` ```python run ```` (Markdown shows it as any Python block); the other Python blocks are fragments (`...`
for the user's part) and are not run. An example that reads `results/tread-digits` finds there a checkpoint in
the format the quick start's run leaves (a tiny model with random weights: the example needs the format, not
the training)."""
import re
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from conftest import tiny_overrides
from dit import get_model
from training.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RUN_BLOCK = re.compile(r"^( *)```python run\n(.*?)^\1```", re.M | re.S)
DIGITS_RUN = "results/tread-digits"


def examples() -> list:
    """(doc, first line, code) of every complete example."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in RUN_BLOCK.finditer(text):
            found.append((str(doc.relative_to(REPO)), text.count("\n", 0, block.start(2)) + 1,
                          textwrap.dedent(block.group(2))))
    return found


EXAMPLES = examples()


def save_digits_run(run_dir: Path):
    """A checkpoint of the digits preset (model=tread, tiny), as train.py writes one: step, weights, EMA, config."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            config = OmegaConf.to_container(compose("config", overrides=tiny_overrides("tread")), resolve=True)
    finally:
        GlobalHydra.instance().clear()
    torch.manual_seed(0)
    weights = get_model(config["model"]["backbone_type"], config["model"]["params"]).state_dict()
    save_checkpoint({"step": 0, "model": weights, "ema": weights, "config": config}, run_dir / "checkpoints", 0)


def test_the_docs_have_complete_examples():
    """The extraction finds the examples the docs promise (an empty list would run nothing)."""
    assert {"docs/sampling.md", "docs/diffusers.md"} <= {doc for doc, _, _ in EXAMPLES}


@pytest.mark.parametrize("doc, line, code", EXAMPLES, ids=[f"{doc}:{line}" for doc, line, _ in EXAMPLES])
def test_example_runs_as_written(doc, line, code, tmp_path, monkeypatch):
    if DIGITS_RUN in code:
        save_digits_run(tmp_path / DIGITS_RUN)
    monkeypatch.chdir(tmp_path)  # what an example writes lands here
    exec(compile(code, f"{doc}:{line}", "exec"), {"__name__": "__main__"})
