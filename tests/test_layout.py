"""The house rules of the layout: six root modules, no import cycle, imports that only point down, and a core
that loads none of the diffusers adapters."""
import subprocess
import sys
import textwrap

from conftest import REPO, subprocess_env
from tools import import_layers

ROOT_MODULES = {"train.py", "sample.py", "fid.py", "dit.py", "routing_module.py"}


def test_root_holds_only_the_design_card_modules():
    assert {p.name for p in REPO.glob("*.py")} == ROOT_MODULES


def test_imports_point_down_without_cycles():
    _, units, problems = import_layers.analyse()
    assert problems == []
    assert "training" not in units["generation"] and "data" not in units.get("tread_utils", set())


def test_analysis_catches_an_upward_import_and_a_cycle(tmp_path):
    for name, text in {"tread_utils/__init__.py": "", "tread_utils/a.py": "import dit\n",
                       "data/__init__.py": "from data import b\n", "data/b.py": "import data.c\n",
                       "data/c.py": "def f():\n    from data.b import g\n", "dit.py": ""}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    _, _, problems = import_layers.analyse(tmp_path)
    assert "tread_utils.a imports dit, a layer above it" in problems
    assert any(p.startswith("import cycle: ") and "data.b" in p and "data.c" in p for p in problems)


def test_every_package_is_found_by_the_install():
    """pyproject finds packages by their __init__.py: a folder of modules without one is left out of a wheel."""
    code_dirs = {p.parent.name for p in REPO.glob("*/*.py") if not p.parent.name.startswith(".")}  # not .paper-code
    code_dirs -= {"tests", "docs", "scripts", "configs", "build"}
    assert all((REPO / name / "__init__.py").is_file() for name in code_dirs), sorted(code_dirs)


def test_the_install_holds_the_product_not_the_lab():
    """`pip install .` installs what a user imports; lab/ (benchmarks, studies) runs from a checkout only."""
    import tomllib

    from setuptools import find_packages

    exclude = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["exclude"]
    installed = {name.split(".")[0] for name in find_packages(str(REPO), exclude=exclude)}
    assert "lab" not in installed
    assert {"training", "generation", "backbones", "tread_diffusers", "edm", "tools"} <= installed


def test_analysis_catches_a_cycle_between_units_that_no_module_cycle_shows(tmp_path):
    """The shape the router once had: routing_module imported backbones.sprint while backbones.diffusers_tread
    imported routing_module. No module imports itself back, but the two units depend on each other."""
    for name, text in {"edm/__init__.py": "", "edm/fusion.py": "", "edm/hooks.py": "import data.x\n",
                       "data/__init__.py": "", "data/x.py": "from edm import fusion\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph, _, problems = import_layers.analyse(tmp_path)
    assert import_layers.find_cycle(graph) is None  # no module cycle ...
    assert problems == ["import cycle between units: data -> edm -> data"], problems  # ... a unit cycle


def test_importing_the_core_loads_no_diffusers_adapter():
    """`import dit` and the entry points load neither the diffusers adapters (tread_diffusers, for the users who
    route a diffusers transformer) nor diffusers itself: run, what the PERIPHERY check reads from the source."""
    code = ("import sys, dit, fid, sample, train; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('diffusers', 'tread_diffusers') or m.startswith('backbones.diffusers')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_analysis_catches_the_core_reaching_the_periphery(tmp_path):
    """A deferred import counts; a module-level `__getattr__` offering a periphery name to its importers does not."""
    for name, text in {"dit.py": "import backbones\nimport backbones.ssm\n",
                       "backbones/__init__.py": "def __getattr__(name):\n    import tread_diffusers\n",
                       "backbones/ssm.py": "def build():\n    from tread_diffusers.tread import apply_tread\n",
                       "tread_diffusers/__init__.py": "from tread_diffusers import tread\n",
                       "tread_diffusers/tread.py": ""}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    _, _, problems = import_layers.analyse(tmp_path)
    assert problems == ["dit reaches tread_diffusers.tread (dit -> backbones.ssm -> tread_diffusers.tread): "
                        "CORE imports no PERIPHERY unit"], problems


def test_the_adapters_keep_their_backbones_names():
    """User code that imports the adapters from `backbones` gets tread_diffusers' objects."""
    import backbones
    import tread_diffusers
    from backbones import apply_tread, diffusers_families, diffusers_masks

    assert apply_tread is tread_diffusers.apply_tread and diffusers_masks is tread_diffusers.masks
    assert diffusers_families.FAMILIES is tread_diffusers.families.FAMILIES
    assert not hasattr(backbones, "diffusers_unknown")
