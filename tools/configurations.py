"""What a run's configuration is, for tools/report.py and lab/study_report.py: its whole resolved config.yaml
but the seed and bookkeeping keys, so runs are averaged only over seeds of one configuration, and the short
`key=value` settings that name each configuration. A config key added later is read at its default in a config
that lacks it (a key is added with the default that keeps what the code did before it), so runs saved before and
after it group together unless one sets it to another value."""
import functools
import json
import re
import statistics
from pathlib import Path

import yaml

# Config keys that cannot change what a run trains or what its evaluations measure: the seed (what a
# configuration's runs are averaged over), where the run writes and what it is called, how it resumes and
# locks, how often it checkpoints and which checkpoints it keeps, how it logs, and the collective timeout.
# Every other key, a new one too, is part of the configuration: settings that can change the numbers without
# changing the method (precision, compile, threads, data loader workers, input file paths) stay in, so runs
# that differ there are separate rows that name the difference, never silently one.
NOT_CONFIGURATION = re.compile(r"(global_seed|results_dir|run_name|resume|lock_stale_minutes|train\.ckpt_every"
                               r"|train\.keep_checkpoints|train\.logging|train\.dist_timeout_minutes)(\..*)?")
# Keys the table shows in columns of their own (model, backbone, routes, ratio): `settings` leaves them out.
IN_COLUMNS = re.compile(r"model\.(name|backbone_type|params\.enable_routing"
                        r"|params\.routes\.\d+\.(start_layer_idx|end_layer_idx|selection_ratio))")
ROUTE_KEY = re.compile(r"model\.params\.routes(\.\d+\.|$)")
UNSET = "unset"  # the value of a key an older config lacks and that has no default


@functools.lru_cache(maxsize=1)
def defaults() -> dict:
    """{dotted key: default}: the typed schema's defaults under configs/config.yaml's values (a dataset or model
    group's are not defaults: runs of one group carry them)."""
    from omegaconf import OmegaConf

    from training.config_schema import ConfigSchema

    schema = flat_config(OmegaConf.to_container(OmegaConf.structured(ConfigSchema), throw_on_missing=False))
    top = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "config.yaml").read_text())
    merged = {**schema, **flat_config({k: v for k, v in top.items() if k not in ("defaults", "hydra")})}
    return {k: v for k, v in merged.items() if v != "???"}


def value(config, key):
    """A config's value of `key`: its own, else the default, else UNSET."""
    return config.get(key, defaults().get(key, UNSET))


def flat_config(node, prefix=""):
    """{dotted key: value} of a config: mappings and lists of mappings (routes) opened, other values kept whole."""
    if isinstance(node, dict) or (isinstance(node, list) and node and all(isinstance(v, dict) for v in node)):
        out = {}
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            out.update(flat_config(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def canonical(value) -> str:
    """A config value as the grouping compares it: 1 and 1.0 are one value (Hydra writes either)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=str)  # str: a foreign config's dates and such


def configuration_key(run):
    """What a run's configuration is: its config but the seed and NOT_CONFIGURATION; a run without a readable
    config.yaml is a configuration of its own."""
    if run.get("config") is None:
        return ("run", run["run"])
    known = defaults()
    return tuple(sorted((k, canonical(v)) for k, v in run["config"].items()
                        if k not in known or canonical(known[k]) != canonical(v)))


def group_by_configuration(runs):
    """[[runs of one configuration]], in the order the configurations first appear."""
    groups = {}
    for r in runs:
        groups.setdefault(configuration_key(r), []).append(r)
    return list(groups.values())


def settings_labels(groups, hidden=IN_COLUMNS):
    """Per group of `group_by_configuration`, `key=value` for each config key whose value differs between the
    groups, where the group's value is not the one most groups have (a majority value sets nothing apart); keys
    matching `hidden` (shown elsewhere) left out. Distinct groups always get distinct labels but for hidden keys."""
    configs = [g[0].get("config") for g in groups]
    present = [c for c in configs if c is not None]
    keys = sorted({k for c in present for k in c if not (hidden and hidden.fullmatch(k))})
    one_route = not any(re.match(r"model\.params\.routes\.[1-9]", k) for c in present for k in c)
    prefix = r"^(model\.params\.(routes\.0\.)?|train\.)" if one_route else r"^(model\.params\.|train\.)"
    short = {k: re.sub(prefix, "", k) for k in keys}
    short = {k: n if list(short.values()).count(n) == 1 else k for k, n in short.items()}  # clashes: full keys
    labels = [[] for _ in groups]
    for key in keys:
        values = [canonical(value(c, key)) if c is not None and applies(c, key) else None for c in configs]
        held = [v for v in values if v is not None]
        for label, config, held_value in zip(labels, configs, values):
            if held_value is not None and len(set(held)) > 1 and 2 * held.count(held_value) <= len(held):
                label.append(f"{short[key]}={shown(value(config, key))}")
    return [", ".join(label) for label in labels]


def applies(config, key):
    """Whether a config has `key` to compare: every key applies, but a route's key only to a config with that route
    (the routes column shows which); a route that lacks a key its peers have counts as `unset`."""
    route = ROUTE_KEY.match(key)
    if key in config or not route:
        return True
    return bool(route.group(1)) and any(k.startswith(route.group(0)) for k in config)


def shown(value) -> str:
    """A config value as Hydra's command line writes it: 1.0 as 1, None as null, true/false."""
    if isinstance(value, float):
        return f"{value:g}"
    if value is None or isinstance(value, (bool, int, list, dict)):
        return json.dumps(value, default=str)
    return str(value)


def seed_mean(runs, values):
    """(mean, n, sample std) of `values` (one per run); the std is None for one run, or for runs of more than one
    configuration, whose spread is not seed noise."""
    one = len({configuration_key(r) for r in runs}) == 1
    return statistics.mean(values), len(values), statistics.stdev(values) if one and len(values) > 1 else None
