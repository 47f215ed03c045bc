"""Every Python block (fenced ```` ```python ````) in README.md and docs/ runs as written, each in a fresh
namespace and its own working directory, like a notebook cell after a few cells the docs name:

- `transformer`, `inputs`: a diffusers transformer and the keyword arguments of its forward (a tiny random SD3
  from tests/diffusers_tiny.py, 4 blocks; noisy latents [2, 4, 8, 8], text, timesteps, `return_dict=False`);
- `routes`: docs/diffusers.md's first routes, `{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2,
  "end_layer_idx": -2}]}`;
- `results/tread-digits`: a checkpoint in the format the quick start's run leaves (a tiny model with random
  weights: the examples need the format, not the training), and `exported/tread-digits`: its export by
  `python -m tools.export`, each there when the block names it.

A name a block uses that it neither defines nor finds above fails the block, naming it. A block that calls
`shard_blocks` runs in a one-process gloo group (as under `torchrun --nproc_per_node 1`); `huggingface_hub`'s
`upload_folder` is a stub that records its arguments, so publishing is checked without the network. What a block
registers (a selection rule, fusion, block type, model size or diffusers family) is taken out again after it."""
import ast
import builtins
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import dit
import routing_module
import tread_diffusers  # noqa: F401  (registers every family before FAMILIES is snapshot)
from conftest import tiny_overrides
from tread_diffusers import families
from training.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PYTHON_BLOCK = re.compile(r"^( *)```python[^\S\n]*\n(.*?)^\1```[^\S\n]*$", re.M | re.S)
PYTHON_FENCE = re.compile(r"^ *```[^\S\n]*py(thon)?3?\b", re.M)  # any fence a reader would take for Python
# At least this many per file, so a renamed fence cannot pass by running nothing.
EXPECTED = {"README.md": 1, "docs/diffusers.md": 6, "docs/export.md": 2, "docs/extensions.md": 4,
            "docs/sampling.md": 1}
DIGITS_RUN = "results/tread-digits"
DIGITS_EXPORT = "exported/tread-digits"
ROUTES = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}
REGISTRIES = [(routing_module, "SELECTIONS"), (dit, "FUSIONS"), (dit, "BLOCK_TYPES"), (dit, "DiT_models"),
              (families, "FAMILIES")]


def examples() -> list:
    """(doc, first line, code) of every Python block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in PYTHON_BLOCK.finditer(text):
            found.append((str(doc.relative_to(REPO)), text.count("\n", 0, block.start(2)) + 1,
                          textwrap.dedent(block.group(2))))
    return found


EXAMPLES = examples()


def free_names(code: str) -> set:
    """The names a block reads without binding them anywhere in it (nor builtins)."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


def ready_names(names: set) -> dict:
    """The documented names (the module doc) of `names`; the transformer and its inputs are built together."""
    ready = {}
    if names & {"transformer", "inputs"}:
        from diffusers_tiny import build

        ready["transformer"], ready["inputs"], _ = build("sd3")
    if "routes" in names:
        ready["routes"] = {"routes": [dict(route) for route in ROUTES["routes"]]}
    return {name: ready[name] for name in names if name in ready}


def save_digits_run(run_dir: Path):
    """A checkpoint of the digits preset (model=tread, tiny), as train.py writes one: step, weights, EMA, config."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            config = OmegaConf.to_container(compose("config", overrides=tiny_overrides("tread")), resolve=True)
    finally:
        GlobalHydra.instance().clear()
    torch.manual_seed(0)
    weights = dit.get_model(config["model"]["backbone_type"], config["model"]["params"]).state_dict()
    save_checkpoint({"step": 0, "model": weights, "ema": weights, "config": config}, run_dir / "checkpoints", 0)


def one_process_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'process_group'}", rank=0, world_size=1)


def test_every_python_block_is_found():
    """Each file has the blocks it is known to have, and no Python fence escapes the extraction (a fence the
    pattern misses would never run)."""
    counts = {}
    for doc, _, _ in EXAMPLES:
        counts[doc] = counts.get(doc, 0) + 1
    short = {doc: counts.get(doc, 0) for doc, least in EXPECTED.items() if counts.get(doc, 0) < least}
    assert not short, f"fewer Python blocks than expected (found): {short}"
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        assert len(PYTHON_FENCE.findall(doc.read_text())) == counts.get(name, 0), name


@pytest.mark.parametrize("doc, line, code", EXAMPLES, ids=[f"{doc}:{line}" for doc, line, _ in EXAMPLES])
def test_example_runs_as_written(doc, line, code, tmp_path, monkeypatch):
    missing = sorted(free_names(code) - {"transformer", "inputs", "routes"})
    assert not missing, f"{doc}:{line} uses {', '.join(missing)}, neither defined in the block nor a ready name"
    if DIGITS_RUN in code or DIGITS_EXPORT in code:
        save_digits_run(tmp_path / DIGITS_RUN)
    if DIGITS_EXPORT in code:
        from tools.export import main as export

        export([str(tmp_path / DIGITS_RUN), "--out", str(tmp_path / DIGITS_EXPORT)])
    monkeypatch.chdir(tmp_path)  # what an example writes lands here
    uploads = []
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: uploads.append(
        {**kw, "exported": sorted(p.name for p in Path(kw["folder_path"]).iterdir())}))
    saved = [(registry, dict(getattr(module, registry))) for module, registry in REGISTRIES]
    grouped = "shard_blocks(" in code
    if grouped:
        one_process_group(tmp_path)
    try:
        exec(compile(code, f"{doc}:{line}", "exec"), {"__name__": "__main__", **ready_names(free_names(code))})
    finally:
        if grouped:
            dist.destroy_process_group()
        for (module, registry), (_, before) in zip(REGISTRIES, saved):
            getattr(module, registry).clear()  # in place: modules that imported the dict by name see it restored
            getattr(module, registry).update(before)
    if "upload_folder(" in code:  # docs/export.md: the export's folder, as it is, to the repository named
        assert uploads == [{"repo_id": "you/tread-digits", "folder_path": DIGITS_EXPORT,
                            "exported": ["README.md", "config.json", "model.safetensors"]}]
    else:
        assert uploads == []
