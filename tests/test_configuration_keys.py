"""The report's configurations (tools/report.py, tools/configurations.py): two runs that differ in any one key of the
resolved config are two rows, but for the keys that cannot change what a run trains or measures, listed here as
tools/configurations.py's comment lists them (seed, where and under what name a run writes, resume and locking,
checkpoint cadence and retention, logging, the collective timeout)."""
import copy
import re

import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg
from tools.configurations import flat_config, group_by_configuration
from tools.report import read_config

BOOKKEEPING = re.compile(r"global_seed|results_dir|run_name|resume|lock_stale_minutes|train\.ckpt_every"
                         r"|train\.dist_timeout_minutes|train\.keep_checkpoints\..*|train\.logging\..*")


def resolved(overrides):
    cfg = compose_cfg(overrides)
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


BASE = resolved(["model=tread", "+model.params.routes.0.options.importance_mix=0.5",
                 "model.params.routes.0.selection=importance"])
KEYS = sorted(flat_config(BASE))


def changed(config, key):
    """`config` with the value at dotted `key` replaced by another of its kind."""
    out = copy.deepcopy(config)
    *path, last = key.split(".")
    node = out
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = int(last) if isinstance(node, list) else last
    value = node[last]
    if isinstance(value, bool):
        node[last] = not value
    elif isinstance(value, (int, float)):
        node[last] = value + 1
    elif isinstance(value, list):
        node[last] = value + [value[-1] if value else 1]
    else:
        node[last] = f"{value}_other"
    return out


def test_the_base_has_the_keys_that_matter():
    assert {"train.compile", "train.mixed_precision", "model.params.routes.0.selection_ratio",
            "model.params.routes.0.options.importance_mix", "train.optimizer.lr", "global_seed"} <= set(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_a_run_differing_in_one_key_is_a_configuration_of_its_own(key):
    runs = [{"run": "a"}, {"run": "b"}]
    read_config(runs[0], BASE)
    read_config(runs[1], changed(BASE, key))
    groups = group_by_configuration(runs)
    assert len(groups) == (1 if BOOKKEEPING.fullmatch(key) else 2), key
