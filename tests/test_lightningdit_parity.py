"""Parity with the TREAD authors' LightningDiT code: the same weights and kept tokens give the same output, input
gradients and parameter gradients, unrouted and routed (bit for bit in float32 on a CPU: the operations are the same).

Needs a clone of https://github.com/stefan-baumann/LightningDiT_TREAD outside this repo, and einops:
    TREAD_LIGHTNINGDIT_CODE=../LightningDiT_TREAD python -m pytest tests/test_lightningdit_parity.py
"""
import importlib.util
import os

import pytest

from lab.lightningdit_parity import failures, parity

CODE = os.environ.get("TREAD_LIGHTNINGDIT_CODE")
pytestmark = [pytest.mark.skipif(not CODE, reason="set TREAD_LIGHTNINGDIT_CODE=<clone of LightningDiT_TREAD>"),
              pytest.mark.skipif(importlib.util.find_spec("einops") is None,
                                 reason="their RoPE imports einops: pip install einops")]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["released", "qk_norm"])
def test_lightningdit_matches_the_authors_code_unrouted_and_routed(qk_norm):
    row = parity(CODE, "LightningDiT-T/2", qk_norm)
    assert not failures([row]), row
    assert row["kept_token_draws"] == [1, 1], "each side routed once, with the same kept tokens"
    assert row["routing_effect"] > 1e-3, "the routed output is not the dense one: the route ran"
