"""lab/flux_host_profile.py's split of a profile by owner: a C function (a torch op) and the standard library's
Python count for the owner of the code that calls them; and docs/performance.md's figures are its records'."""
import cProfile
import functools
import itertools
import json
import pstats
import re

import torch

from lab.flux_host_profile import OWNERS, REPO, split_by_owner
from routing_module import start_route


def test_torch_ops_and_the_standard_library_count_for_their_callers_owner():
    x, keep = torch.randn(1, 8, 4), torch.arange(4)[None]
    routed = functools.lru_cache(maxsize=None)(lambda: start_route(x, keep))  # called through a C wrapper
    profile = cProfile.Profile()
    profile.enable()
    routed()
    profile.disable()
    table, ours = split_by_owner(pstats.Stats(profile))
    python_ms, c_ms, calls = table["ours"]
    assert python_ms > 0 and c_ms > 0 and calls >= 3  # start_route, _expand; torch.gather, expand, unsqueeze
    assert all(table[who][2] == 0 for who in OWNERS if who.startswith("torch"))
    assert ours["routing_module.py:start_route"][0] > 0 and ours["routing_module.py:start_route"][1] == 1


# docs/performance.md's table of the routed step's host time, row by row: the owner each row is
ROWS = {"ours": "ours", "peft's": "peft", "diffusers'": "diffusers", "torch: nn.Module's": "torch: nn.Module calls",
        "torch: the layers": "torch: layers", "torch: the checkpoint's": "torch: checkpoint",
        "torch: the autograd": "torch: autograd engine", "torch: AdamW": "torch: optimizer",
        "torch: the rest": "torch: other", "the step's": "the step (tools/, lab/)"}


def test_the_performance_page_gives_the_records_figures():
    """Each row's ms and share (after the cut, and before it where given) and calls are the records'."""
    perf = REPO / "docs" / "perf"
    after, before = (json.loads((perf / name).read_text())["routed"]
                     for name in ("flux_host_profile_cpu.json", "flux_host_profile_cpu_885351b.json"))
    text = (REPO / "docs" / "performance.md").read_text()
    lines = text[text.index("| owner | ms per step, profiled | share | calls per step |"):].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in itertools.takewhile(bool, lines)]
    assert len(rows) == len(ROWS)
    for label, ms, share, calls in rows:
        who = next(owner for prefix, owner in ROWS.items() if label.startswith(prefix))
        for record, ms_given, share_given in zip((after, before), re.findall(r"[\d.]+", ms),
                                                 re.findall(r"[\d.]+", share)):
            spent = record["owners"][who]["python_ms"] + record["owners"][who]["c_ms"]
            assert float(ms_given) == round(spent, 1) and float(share_given) == round(
                100 * spent / record["profiled_step_ms"], 1), label
        assert int(calls.replace(",", "")) == after["owners"][who]["calls"] == before["owners"][who]["calls"]
    steps = f"The profiled steps took {after['profiled_step_ms']:.0f} ms ({before['profiled_step_ms']:.0f} before) " \
            f"and {after['step_ms']:.0f} and {before['step_ms']:.0f} ms of CPU time unprofiled"
    assert steps in " ".join(text.split())
