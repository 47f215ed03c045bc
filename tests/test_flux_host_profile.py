"""lab/flux_host_profile.py's split of a profile by owner: a C function (a torch op) and the standard library's
Python count for the owner of the code that calls them."""
import cProfile
import functools
import pstats

import torch

from lab.flux_host_profile import OWNERS, split_by_owner
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
