"""Every command in README.md and docs/ runs as written, checked as deeply as can be without
running it: Hydra overrides compose with configs/ and pass the entry point's validation (every job of a
sweep checked at its corners), argparse CLIs parse their arguments, and modules, scripts, pip extras,
pytest markers and environment variables exist. Shell commands come from ```bash blocks and from inline
code spans that start like a command (not those with `...` placeholders)."""
import contextlib
import copy
import functools
import importlib
import importlib.util
import io
import re
import shlex
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.launch import launch_command_parser
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import sample
from training.config_check import check_train_config
from tread_utils.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CONFIGS = REPO / "configs"
# fences may be indented (a code block inside a list item); a block closes at its own indentation
SHELL_BLOCK = re.compile(r"^( *)```(?:bash|sh|shell)\n(.*?)^\1```", re.M | re.S)
FENCE = re.compile(r"^( *)```.*?^\1```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
COMMAND_START = ("python ", "accelerate launch", "pip install", "scripts/", "bash scripts/")
SEPARATORS = {";", "&&", "||", "|", "&"}
EXTERNAL = {"git", "wget", "tensorboard"}  # commands of other tools, named in the docs for context: not checked
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LEADING_ASSIGNMENTS = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class CommandError(AssertionError):
    """A documented command that would not run as written."""


@dataclass
class Command:
    doc: str
    line: int
    text: str
    inline: bool  # an inline code span: a bare `python -m MODULE` names a module, its arguments are elsewhere

    def __str__(self):
        return f"{self.doc}:{self.line}: {self.text}"


def shell_lines(block: str) -> list:
    """(offset in block, logical line): continuation backslashes joined, a `for` loop kept whole."""
    out, start, pending = [], 0, ""
    for i, line in enumerate(block.splitlines()):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        if sum((w == "do") - (w == "done") for w in tokens(pending)) > 0:
            pending += "\n;"  # the loop's next line: a new command (after any comment)
            continue
        out.append((start, pending))
        pending = ""
    return out


def doc_commands(path: Path, text=None) -> list:
    text, doc = text or path.read_text(), str(path.relative_to(REPO))
    found = []
    for block in SHELL_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(2)) + 1
        found += [Command(doc, first + i, line.strip(), False) for i, line in shell_lines(block.group(2))
                  if line.strip() and not line.strip().startswith("#")]
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # line numbers kept
    for span in INLINE.finditer(prose):
        code = " ".join(span.group(1).split())
        if LEADING_ASSIGNMENTS.sub("", code).startswith(COMMAND_START) and "..." not in code:
            found.append(Command(doc, prose.count("\n", 0, span.start()) + 1, code, True))
    return found


def tokens(text: str) -> list:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


# ------------------------------------------------------------------------------------------------------
# Shell: segments, loops, variables


def segments(words: list) -> list:
    out, current = [], []
    for w in words:
        if w in SEPARATORS:
            out.append(current)
            current = []
        else:
            current.append(w)
    return [s for s in out + [current] if s]


def expand(word: str, env: dict) -> str:
    def value(m):
        if m.group(1) not in env:
            raise CommandError(f"${m.group(1)} is not set by the documented commands")
        return env[m.group(1)]
    return SHELL_VAR.sub(value, word)


def check_shell(text: str, bindings: dict = None):
    """Each simple command of a shell line; a `for` loop's body at the loop's first and last values."""
    loops, body = {}, []
    for seg in segments(tokens(text)):
        while seg and seg[0] in ("do", "then"):
            seg = seg[1:]
        if not seg or seg[0] in ("done", "fi"):
            continue
        if seg[0] == "for":
            if len(seg) < 4 or seg[2] != "in":
                raise CommandError(f"cannot read the loop {' '.join(seg)}")
            loops[seg[1]] = seg[3:]
        else:
            body.append(seg)
    corners = [{k: v[0] for k, v in loops.items()}, {k: v[-1] for k, v in loops.items()}]
    for env in corners if loops else [{}]:
        for seg in body:
            check_simple([expand(w, {**(bindings or {}), **env}) for w in seg])


def check_simple(words: list):
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    if not words:
        raise CommandError("only variable assignments, no command")
    name, args = words[0], words[1:]
    if name in EXTERNAL:
        return
    if name.endswith(".sbatch"):  # the job script named in prose
        return check_sbatch_script(name)
    if name == "sbatch":
        scripts = [i for i, a in enumerate(args) if a.endswith(".sbatch")]
        if scripts:  # sbatch [options] SCRIPT [its arguments]
            return check_sbatch_script(args[scripts[0]], args[scripts[0] + 1:])
        wrapped = [a.partition("=")[2] for a in args if a.startswith("--wrap=")] + \
                  [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--wrap"]
        if not wrapped:
            raise CommandError("sbatch without --wrap or a job script: nothing of ours to check")
        return check_shell(wrapped[0], env)
    if name == "pip":
        return check_pip(args)
    if name == "accelerate":
        return check_accelerate(args, env)
    if name in ("python", "python3"):
        return check_python(args, env, processes=1)
    if name == "bash" or name.endswith(".sh"):
        return check_script(args[0] if name == "bash" else name, env, executable=name != "bash")
    raise CommandError(f"unknown command {name!r}")


def project_sources():
    """The project's own .py files: not virtual environments (.venv, CI's .venv-ci), caches or run outputs."""
    return [p for p in REPO.rglob("*.py")
            if not any(part.startswith(".") or part in ("results", "build", "__pycache__")
                       for part in p.relative_to(REPO).parts)]


def check_env(env: dict, where: str):
    """Each variable set in front of a command is read by the code it starts."""
    if not env:
        return
    sources = [p.read_text() for p in project_sources() if p != Path(__file__)] if where == "python" \
        else [(REPO / where).read_text()]
    for name in env:
        if not any(name in s for s in sources):
            raise CommandError(f"{name}= is read nowhere in {where}")


def check_script(path: str, env: dict, executable: bool):
    script = REPO / path
    if not script.is_file():
        raise CommandError(f"no script {path}")
    if executable and not script.stat().st_mode & 0o111:
        raise CommandError(f"{path} is not executable (run it with bash, or chmod +x)")
    check_env(env, path)


SLURM_STUBS = {  # what a 2-node allocation's commands give; `accelerate` records its arguments instead
    "scontrol": 'printf "node1\\nnode2\\n"',
    "srun": 'SLURM_NODEID=1 "$@"',
    "accelerate": 'printf "%s\\0" "$@" > "$ACCELERATE_ARGS"',
}


def check_sbatch_script(path: str, script_args=()):
    """A Slurm job script, run by bash (with `script_args`) as on the second node of a 2-node job (scontrol, srun
    and accelerate stubbed): the `accelerate launch` it would run is checked like any documented one."""
    import subprocess

    script = REPO / path
    if not script.is_file():
        raise CommandError(f"no job script {path}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, body in SLURM_STUBS.items():
            stub = Path(tmp) / name
            stub.write_text(f"#!/bin/bash\n{body}\n")
            stub.chmod(0o755)
        record = Path(tmp) / "accelerate_args"
        env = {"PATH": f"{tmp}:/usr/bin:/bin", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
               "ACCELERATE_ARGS": str(record)}
        proc = subprocess.run(["bash", str(script), *script_args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0 or not record.is_file():
            raise CommandError(f"{path} did not reach accelerate launch: {proc.stderr.strip()[-300:]}")
        args = record.read_text().split("\0")[:-1]
    opts = quiet(launch_command_parser().parse_args, args[1:])
    if (opts.num_machines, opts.machine_rank, opts.main_process_ip, opts.num_processes) != (2, 1, "node1", 16):
        raise CommandError(f"{path}: accelerate launch {' '.join(args[1:])} does not join 2 nodes of 8 GPUs")
    check_accelerate(args, {})


def check_pip(args: list):
    if args[:1] != ["install"]:
        raise CommandError(f"pip {' '.join(args)}: only `pip install` is documented")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = {re.match(r"[\w.-]+", d).group(0) for d in project["dependencies"]}
    values = {i + 1 for i, a in enumerate(args) if a in ("--index-url", "--extra-index-url")}  # an option's value
    if any(args[i] != "https://download.pytorch.org/whl/cpu" for i in values if i < len(args)):
        raise CommandError(f"pip {' '.join(args)}: the only index documented is PyTorch's CPU wheels")
    targets = [a for i, a in enumerate(args[1:], 1) if not a.startswith("-") and i not in values]
    for target in targets:
        base, _, rest = target.partition("[")
        if base in needed and not rest and values:  # a dependency of ours from another index (torch's CPU wheel)
            continue
        if base != ".":
            raise CommandError(f"pip install {target}: not this repository (install it as `.` or `.[extra]`)")
        unknown = [e for e in rest.rstrip("]").split(",") if e and e not in extras]
        if unknown:
            raise CommandError(f"pip extra(s) {', '.join(unknown)} not in pyproject.toml (has {', '.join(extras)})")


def check_accelerate(args: list, env: dict):
    if args[:2] == ["config", "default"]:  # accelerate's defaults for the machine, written once (the quick start)
        from accelerate.commands.config import get_config_parser

        return quiet(get_config_parser().parse_args, args[1:])
    if args[:1] != ["launch"]:
        raise CommandError(f"accelerate {' '.join(args)}: only `accelerate launch` is documented")
    opts = quiet(launch_command_parser().parse_args, args[1:])
    target = ["-m", opts.training_script] if opts.module else [opts.training_script]
    check_python(target + opts.training_script_args, env, processes=opts.num_processes or 1)


# ------------------------------------------------------------------------------------------------------
# Python entry points


def check_python(args: list, env: dict, processes: int):
    check_env(env, "python")
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "pytest":
            return check_pytest(rest)
        if not module_exists(module):
            raise CommandError(f"no module {module}")
    else:
        script = REPO / args[0]
        if not script.is_file():
            raise CommandError(f"no script {args[0]}")
        module, rest = ".".join(script.relative_to(REPO).with_suffix("").parts), args[1:]
    if module == "train":
        return check_train(rest, processes)
    if module == "sample":
        return check_sample(rest)
    if module == "training.flops":
        return compose_checked("config", tuple(quiet(get_args_parser().parse_args, rest).overrides))
    check_argparse(module, rest)


def quiet(parse, args):
    """parse(args) with argparse's output captured: --help is fine, an error becomes a CommandError."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parse(args)
    except SystemExit as e:
        if e.code:
            raise CommandError(f"arguments refused: {err.getvalue().strip() or out.getvalue().strip()}") from None
    except UserError as e:
        raise CommandError(f"arguments refused: {e}") from None


def check_argparse(module: str, args: list):
    mod = importlib.import_module(module)
    if hasattr(mod, "parse_args"):
        return quiet(mod.parse_args, args)
    if hasattr(mod, "build_parser"):
        return quiet(mod.build_parser().parse_args, args)
    if args or not hasattr(mod, "main"):
        raise CommandError(f"{module} has no build_parser() to check {args} against")


def check_pytest(args: list):
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = {m.partition(":")[0] for m in markers}
    i = 0
    while i < len(args):
        if args[i] == "-n":  # pytest-xdist's workers (the test extra has it)
            if not (args[i + 1] == "auto" or args[i + 1].isdigit()):
                raise CommandError(f"pytest -n {args[i + 1]}: give a number of workers or auto")
            i += 1
        elif args[i] == "-m":
            if args[i + 1] not in names:
                raise CommandError(f"pytest marker {args[i + 1]!r} is not registered (have {', '.join(names)})")
            i += 1
        elif args[i].startswith("-"):
            raise CommandError(f"pytest option {args[i]} is not checked here: add it to check_pytest")
        elif not (REPO / args[i].partition("::")[0]).exists():
            raise CommandError(f"no test path {args[i]}")
        i += 1


def check_sample(args: list):
    if any(a in ("-h", "--help") for a in args):
        return
    try:
        cfg = sample.compose_config(args)
        sample.resolve_seeds(cfg.num_samples, OmegaConf.to_object(cfg.seeds) if OmegaConf.is_list(cfg.seeds)
                             else cfg.seeds)
    except (UserError, OmegaConfBaseException) as e:
        raise CommandError(f"sample.py refuses it: {e}") from None


# ------------------------------------------------------------------------------------------------------
# train.py: Hydra flags, sweeps, launcher, the config check


@functools.lru_cache(maxsize=None)
def compose_groups(config_name: str, groups: tuple):
    """Hydra's composition of the defaults list with these group choices (cached: few distinct ones)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name, overrides=list(groups), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def compose_checked(config_name: str, overrides: tuple):
    """The config Hydra composes, hydra node included: the group choices (`model=dit`, `+sweep=ratio`)
    compose the defaults, then Hydra's own step applies the value overrides, as `compose` does. A
    composition error is a CommandError."""
    groups = tuple(o for o in overrides if (CONFIGS / o.partition("=")[0].lstrip("+~")).is_dir())
    try:
        cfg = copy.deepcopy(compose_groups(config_name, groups))
        values = OverridesParser.create().parse_overrides([o for o in overrides if o not in groups])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg
    except (HydraException, OmegaConfBaseException) as e:
        raise CommandError(f"configs/{config_name}.yaml does not compose with {list(overrides)}: "
                           f"{str(e).split('Config search path')[0].strip()}") from None


def launcher_overrides(overrides: list) -> list:
    """The launcher's overrides, checked against configs/hydra/launcher/ when its plugin is not installed
    (then they are dropped: the rest of the command is still composed)."""
    if module_exists("hydra_plugins.hydra_submitit_launcher"):
        return overrides
    kept, launcher = [], None
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "hydra/launcher":
            if not (CONFIGS / "hydra" / "launcher" / f"{value}.yaml").is_file():
                raise CommandError(f"hydra/launcher={value}: no configs/hydra/launcher/{value}.yaml")
            launcher = OmegaConf.load(CONFIGS / "hydra" / "launcher" / f"{value}.yaml")
        elif key.startswith("hydra.launcher."):
            if launcher is None or key.removeprefix("hydra.launcher.") not in launcher:
                raise CommandError(f"{key}: not a field of the launcher's yaml (install its plugin to check others)")
        else:
            kept.append(o)
    return kept


def train_jobs(overrides: list, multirun: bool) -> list:
    """The override lists of the jobs Hydra would run: one, or a sweep's first and last job (a preset's
    `hydra.sweeper.params` first, the command line's values replacing them, as BasicSweeper does)."""
    if not multirun:
        swept = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]
        if swept:
            raise CommandError(f"{', '.join(swept)}: a sweep without -m (Hydra refuses it)")
        return [overrides]
    sweeper = tuple(o for o in overrides if o.lstrip("+").startswith(("sweep=", "hydra.sweeper")))
    params = compose_checked("config", sweeper).hydra.sweeper.params or {} if sweeper else {}
    preset = [f"{k}={v}" for k, v in params.items()]
    parsed = OverridesParser.create().parse_overrides(preset + overrides)
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    return [jobs[0], jobs[-1]]


def local_stand_ins(cfg, root: Path) -> list:
    """Each path of `cfg` that exists only on a cluster (/data/...) or is made by an earlier command on the page
    (a relative run or export folder) set to an empty local stand-in under `root` (a file if it has a suffix,
    else a folder); returns those paths."""
    replaced = []
    for key in ("dataset.train_path", "init_from", "train.eval.ref_batch", "train.eval.inception_weights"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and not Path(value).exists():
            local = root / value.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            if local.suffix:
                local.touch()
            else:
                local.mkdir(exist_ok=True)
            OmegaConf.update(cfg, key, str(local))
            replaced.append(value)
    return replaced


@functools.lru_cache(maxsize=None)
@mock.patch("training.eval_inputs.check_eval_inputs", lambda cfg: None)  # the VAE, Inception weights and
# reference are the running machine's (tests/test_imagenet_offline.py); so is init_from's run (test_init_from.py)
@mock.patch("training.config_check.check_init_from_source", lambda cfg: None)
def train_job(job: tuple, processes: int):
    """One job as train.py's main gets it: composed, without the hydra node, through the config check."""
    composed = compose_checked("config", job)
    cfg = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
    try:
        check_train_config(cfg, world_size=processes, overrides=job)
    except UserError as e:
        with tempfile.TemporaryDirectory() as root:
            cluster = local_stand_ins(cfg, Path(root))
            if not ("does not exist" in str(e) and any(p in str(e) for p in cluster)):
                raise CommandError(f"train.py refuses {list(job)}: {e}") from None
            try:  # a cluster's files stand in as empty local ones: everything else is checked
                check_train_config(cfg, world_size=processes)
            except UserError as e2:
                raise CommandError(f"train.py refuses {list(job)} (cluster paths {cluster} made local): {e2}") \
                    from None


def check_train(args: list, processes: int):
    hydra_args = quiet(get_args_parser().parse_args, args)
    overrides = launcher_overrides(hydra_args.overrides)
    if hydra_args.cfg:
        cfg = compose_checked("config", tuple(overrides))
        if hydra_args.package and OmegaConf.select(cfg, hydra_args.package) is None:
            raise CommandError(f"--cfg {hydra_args.cfg} -p {hydra_args.package}: no such package")
        return
    for job in train_jobs(overrides, hydra_args.multirun):
        train_job(tuple(job), processes)


# ------------------------------------------------------------------------------------------------------


def test_docs_have_commands():
    """The extraction finds the commands the README is built around (an empty list would check nothing)."""
    texts = [c.text for c in COMMANDS]
    for needle in ("accelerate launch train.py model=tread", "python sample.py ckpt=", "python fid.py calc",
                   "python evaluations/evaluator.py", "python -m data.extract_latents", "python train.py -m"):
        assert any(t.startswith(needle) for t in texts), needle
    assert any(c.doc.startswith("docs/") for c in COMMANDS)
    for doc in DOCS:  # every shell fence opens a block the extraction reads (none swallowed by a mispaired fence)
        text = doc.read_text()
        assert len(SHELL_BLOCK.findall(text)) == len(re.findall(r"^ *```(?:bash|sh|shell)$", text, re.M)), doc


def test_blocks_inside_list_items_are_read_and_close_at_their_indentation():
    """An indented fence (a list item's code block) is a block like any other; the prose after it is still read,
    so no later command is lost to fences paired wrongly."""
    text = ("- item:\n  ```bash\n  python train.py \\\n      model=dit\n  ```\n  and `python sample.py ckpt=a`\n\n"
            "```bash\npython fid.py calc\n```\n`python -m lab.bench`\n")
    found = [(c.line, " ".join(c.text.split()), c.inline) for c in doc_commands(REPO / "README.md", text)]
    assert found == [(3, "python train.py model=dit", False), (9, "python fid.py calc", False),
                     (6, "python sample.py ckpt=a", True), (11, "python -m lab.bench", True)]


def test_the_quick_start_caps_a_run():
    """The README's quick start shows the key that caps a run, in a command that composes with it set."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start"))]
    capped = [c for c in COMMANDS if c.doc == "README.md" and c.text in quick and "train.max_steps=" in c.text]
    assert capped, "no quick-start command sets train.max_steps"
    for command in capped:
        check_shell(command.text)
        (cap,) = re.findall(r"train\.max_steps=(\d+)", command.text)
        overrides = [w for w in tokens(command.text) if "=" in w]
        assert compose_checked("config", tuple(overrides)).train.max_steps == int(cap)


OUTPUT = re.compile(r"(?:--out(?:-dir)?\s+|(?<![\w.])(?:out|grid|results_dir)=)(\S+)")


def test_readme_commands_write_nowhere_git_tracks():
    """What a README command writes inside the checkout is git-ignored (or it goes outside it): running them
    leaves `git status` clean and no committed file is overwritten."""
    import subprocess

    written = {m for c in COMMANDS if c.doc == "README.md" for m in OUTPUT.findall(c.text)}
    assert {"samples.npz", "exported/tread-digits", "finetune_lora_digits.log"} <= written, written
    for path in sorted(written):
        if Path(path).is_absolute():
            assert REPO not in Path(path).parents, path
            continue
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0
        assert ignored, f"a README command writes {path}, which git does not ignore"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_command_runs_as_written(command):
    """Each documented command: entry point, arguments and config keys as the code accepts them."""
    if command.inline and re.fullmatch(r"python -m [\w.]+|accelerate launch", command.text):  # a mention
        assert command.text == "accelerate launch" or module_exists(command.text.split()[-1]), command
        return
    try:
        check_shell(command.text)
    except CommandError as e:
        pytest.fail(f"{command}\n  {e}", pytrace=False)


@pytest.mark.parametrize("text, needle", [
    ("python train.py model.params.no_such_key=1", "no_such_key"),
    ("accelerate launch train.py model=tread train.max_step=2", "max_step"),
    ("python train.py -m model.params.routes.0.end_layer_idx=4,12", "end_layer_idx=12"),
    ("python train.py model.params.routes.0.end_layer_idx=4,6", "without -m"),
    ("python -m tools.no_such_tool --out x", "no module tools.no_such_tool"),
    ("python fid.py calc --images a.npz --ref b.npz --feature-network digits", "--feature-network"),
    ("python sample.py ckpt=run cfg=1.5", "unknown config key cfg"),
    ("python train.py model=treadx", "treadx"),
    ("for e in 4 12; do python train.py model.params.routes.0.end_layer_idx=$e; done", "end_layer_idx=12"),
    ("STEPS=9 scripts/no_such_script.sh", "no script scripts/no_such_script.sh"),
    ("python -m data.extract_latents convert-maskdit a b --resolution 512", "--resolution"),
    ('pip install -e ".[no_such_extra]"', "no_such_extra"),
    ("pip install torchx --index-url https://download.pytorch.org/whl/cpu", "pip install torchx: not this repository"),
    ("pip install torch --index-url https://example.com/simple", "the only index documented"),
    ("accelerate config default --mixed_precision fp9", "fp9"),
    ("TREAD_NO_SUCH_VAR=1 python -m lab.bench", "TREAD_NO_SUCH_VAR"),
    ("python train.py dataset=imagenet256 dataset.train_path=/data/imagenet256-latents", "ref_batch"),
])
def test_broken_commands_are_refused(text, needle):
    """The checker itself: an unknown key, module, flag, extra or variable fails, naming it."""
    with pytest.raises(CommandError, match=re.escape(needle)):
        check_shell(text)
