"""Writes docs/configuration.md, the configuration reference: every key of the training config
(configs/config.yaml and its groups) and of sample.py's (configs/sample.yaml), its meaning from the
schema's `doc` (training/config_schema.py) and its value from the YAML files, per preset where the presets
differ (dataset digits / imagenet256, model tread / dit, diffuser edm / rf).

    python -m tools.config_doc            # rewrites docs/configuration.md

tests/test_config_schema.py fails when the committed file differs from a fresh one.
"""
import argparse
import dataclasses
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dit import FUSIONS
from routing_module import SELECTIONS, keyword_options
from training import config_schema as S
from training.config_check import list_element

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "configuration.md"
# The training presets the reference compares: the default composition, then one group changed at a time.
DEFAULT = {"dataset": "digits", "model": "tread", "diffuser": "edm"}
VARIANTS = {"dataset": "imagenet256", "model": "dit", "diffuser": "rf"}

HEADER = """# Configuration reference

Written by `python -m tools.config_doc` from `training/config_schema.py` (what each key means) and
`configs/*.yaml` (its value); edit those, then run the command. Every key is a Hydra override, e.g.
`python train.py train.optimizer.lr=2e-4 run_name=lr2e-4` or `python sample.py ckpt=RUN num_samples=100 cfg_scale=1.5`.
The schema is the base the YAML files extend, so an unknown key or a value of the wrong type is refused
when the config is composed, and a key the YAML leaves out takes the default given here.

Training presets: `dataset=digits` (the default) or `imagenet256`, `model=tread` (the default) or `dit`,
`diffuser=edm` (the default) or `rf`. Where a preset changes a value, the cell names each: the first is
the default's. `???` is a value to give on the command line; `${...}` takes another key's value.
"""


def compose_config(name: str, overrides=()):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(name, overrides=list(overrides)), resolve=False)


def lookup(tree, path):
    for part in path:
        if isinstance(tree, list):
            tree = tree[part] if part < len(tree) else None
        elif isinstance(tree, dict):
            tree = tree.get(part)
        else:
            return None
    return tree


def show(value) -> str:
    return f"`{flow(value)}`".replace("|", "\\|")


def flow(value) -> str:
    """A value as YAML's flow style writes it: null, true, [0.9, 0.999]."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def cell(presets: dict, path) -> str:
    """The value under each preset: one value, or `group option: value` for each that differs."""
    default = lookup(presets[None], path)
    parts = []
    for group, option in VARIANTS.items():
        value = lookup(presets[group], path)
        if value != default:
            parts.append(f"{DEFAULT[group]}: {show(default)}, {option}: {show(value)}")
    return "; ".join(parts) if parts else show(default)


def sections(cls, title: str, path: tuple, presets: dict, out: list):
    """One table per schema node (its leaf keys), then the nodes below it, depth first."""
    rows, nested, presets_below = [], [], presets
    for field in dataclasses.fields(cls):
        key, doc, element = f"{title}.{field.name}" if title else field.name, meaning(field), list_element(field.type)
        if dataclasses.is_dataclass(field.type):
            nested.append((field.type, key, path + (field.name,)))
        elif element is not None and dataclasses.is_dataclass(element):
            rows.append((field.name, route_count(presets, path + (field.name,)), doc))
            nested.append((element, f"{key}.N", path + (field.name, 0)))
            presets_below = {group: presets[None] for group in presets}  # the default preset's routes only
        else:
            rows.append((field.name, cell(presets, path + (field.name,)), doc))
    if rows:
        out.append(f"\n### `{title or 'top level'}`\n")
        out.append("| key | value | meaning |\n|---|---|---|")
        out += [f"| `{name}` | {value} | {doc.replace('|', chr(92) + '|')} |" for name, value, doc in rows]
    for tp, key, sub in nested:
        sections(tp, key, sub, presets_below if sub[-1] == 0 else presets, out)


def meaning(field) -> str:
    """A key's doc and, where its field has one, the rule its value follows."""
    rule = field.metadata.get("rule")
    return field.metadata["doc"] + (f"; {rule.allowed}" if rule is not None else "")


def route_count(presets: dict, path) -> str:
    """A list of schema nodes (the routes): how many each preset has; their keys get a table of their own."""
    count = {group: len(lookup(tree, path) or []) for group, tree in presets.items()}
    parts = [f"{DEFAULT[group]}: {count[None]}, {option}: {count[group]}" for group, option in VARIANTS.items()
             if count[group] != count[None]]
    return f"{'; '.join(parts) or count[None]} (below: the values of the default's first)"


def registry_table(title: str, intro: str, entries: dict, what: str) -> str:
    """A registry's entries, each its first doc line and its options (keyword-only parameters, `keyword_options`),
    so an entry added there, by this package or by a user's module, is documented here without an edit."""
    out = [f"\n### {title}\n", intro, f"| name | {what} | options (type, allowed values; default) |", "|---|---|---|"]
    for name, fn in entries.items():
        options = [f"`{key}` ({kind.__name__}{f', {allowed}' if allowed else ''}; default {flow(default)})"
                   for key, (kind, allowed, default) in keyword_options(fn).items()]
        doc = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        out.append(f"| `{name}` | {doc.replace('|', chr(92) + '|')} | {', '.join(options) or '-'} |")
    return "\n".join(out)


def selection_rules() -> str:
    return registry_table("Selection rules (`model.params.routes.N.selection`)",
                          "A rule's options go under the route's `options`, e.g. "
                          "`+model.params.routes.0.options.importance_mix=0.3` (Hydra's `+` adds a key to a mapping).\n",
                          SELECTIONS, "what it keeps")


def fusions() -> str:
    return registry_table("Fusions (`model.params.routes.N.fusion`)",
                          "How a route gives the sequence back when it is not TREAD's rejoin (`none`, the default). A "
                          "fusion's options go under the route's `fusion_options`, e.g. "
                          "`+model.params.routes.0.fusion_options.path_drop_prob=0.2`.\n",
                          {name: entry.build for name, entry in FUSIONS.items()}, "what it builds")


def render() -> str:
    presets = {None: compose_config("config")}
    presets.update({group: compose_config("config", [f"{group}={option}"]) for group, option in VARIANTS.items()})
    out = [HEADER, "## Training: `train.py` (configs/config.yaml)"]
    sections(S.ConfigSchema, "", (), presets, out)
    out.append(selection_rules())
    out.append(fusions())
    out.append("\n## Sampling: `sample.py` (configs/sample.yaml)")
    sample = compose_config("sample")
    sections(S.SampleSchema, "", (), {None: sample, **{g: sample for g in VARIANTS}}, out)
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: docs/configuration.md)")
    args = parser.parse_args(argv)
    args.out.write_text(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
