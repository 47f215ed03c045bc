"""The config key `imports`: modules of the user's own that register selection rules, fusions, blocks, model
sizes, ... (docs/extensions.md, "Your own code"). Each entry point imports them before it checks a config, and
again from a run's saved config wherever a run is read. Torch-free: a module is imported before torch is.
"""
import importlib
import os
import re
import sys
import traceback

from tread_utils.errors import UserError

KEY = "imports"
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def import_user_modules(names, source: str = "") -> list:
    """Import each module of `names` (module names; None or []: none), with the working directory on the import
    path (after the interpreter's own entries, so a file there never shadows a module this code imports). Already
    imported modules are not run again. `source`: where the names come from, when not the command's own config
(a run's saved config), for a refusal."""
    names = [str(n) for n in names or []]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `python train.py` puts the script's folder first, not cwd
        sys.path.append(cwd)
    for name in names:
        if not MODULE_NAME.fullmatch(name) or name.endswith(".py"):
            stem = os.path.splitext(os.path.basename(name))[0] or "my_rules"
            raise UserError(f"{KEY}=[{name}]{source}: give a module name, e.g. {KEY}=[{stem}], with its file in the working "
                            f"directory or its folder on PYTHONPATH")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                raise UserError(f"{KEY}=[{name}]{source}: no module {name} in the working directory {cwd} or on PYTHONPATH; "
                                f"run from the folder that holds {name.split('.')[0]}, or add that folder to "
                                f"PYTHONPATH") from None
            raise UserError(failed(source, name, e)) from None
        except Exception as e:  # the user's code raised: its own error, where it was raised, in one line
            raise UserError(failed(source, name, e)) from None
    return names


def failed(source: str, name: str, e: Exception) -> str:
    if isinstance(e, SyntaxError):
        place = (e.filename, e.lineno)
    else:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        place = (frame.filename, frame.lineno)
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{KEY}=[{name}]{source}: importing {name} failed: {type(e).__name__}: {message} ({place[0]}, line {place[1]})"


def import_saved(run_config, source: str) -> list:
    """The modules a run's saved config (a checkpoint's `config`) names, imported before its model is built."""
    return import_user_modules(run_config.get(KEY) if isinstance(run_config, dict) else None, f" (saved with {source})")
