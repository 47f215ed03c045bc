"""Parity with SimpleTuner's TREAD router (lab/simpletuner_parity.py); runs when TREAD_SIMPLETUNER names a
SimpleTuner checkout or installed package."""
import os

import pytest

from lab.simpletuner_parity import RATIOS, TOKENS, compare, load_router, main

SIMPLETUNER = os.environ.get("TREAD_SIMPLETUNER")
needs_simpletuner = pytest.mark.skipif(not SIMPLETUNER, reason="set TREAD_SIMPLETUNER=<SimpleTuner checkout>")


@needs_simpletuner
def test_simpletuner_kept_counts_match_theirs_with_and_without_force_keep():
    router_cls, _ = load_router(SIMPLETUNER)
    result = compare(router_cls)
    assert len(result["rows"]) == len(TOKENS) * len(RATIOS)
    bad = [r for r in result["rows"] if r["simpletuner"] != r["ours"] or r["simpletuner_forced"] != r["ours_forced"]]
    assert not bad and result["same"], bad[:3]
    assert result["authors_differ"] > 0  # the option matters: the default count is not theirs


def test_a_missing_simpletuner_directory_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--simpletuner-code", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "no simpletuner/helpers/training/tread.py" in err and "\n" not in err
