"""lab/token_table.py on the archived 16-token study: its fixed-step rows agree with the study report's CSV
(docs/results/study.csv, written by lab/study_report.py from the same runs), its equal-time row reads dit where
the cost part's steps/s put it, and a bad archive argument is one line."""
import csv
import re
from pathlib import Path

import pytest

from lab import token_table

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = ROOT / "docs/results/runs"


def study_csv(step, metric):
    with open(ROOT / "docs/results/study.csv") as f:
        return next(r for r in csv.DictReader(f) if (r["part"], r["routed"], r["step"], r["metric"])
                    == ("compare", "tread 2->8 @ 0.5", str(step), metric))


def test_fixed_steps_agree_with_the_study_report(capsys):
    token_table.main([f"16={ARCHIVE}"])
    lines = capsys.readouterr().out.splitlines()
    for step in token_table.STEPS:
        cells = [c.strip() for c in next(l for l in lines if f"| step {step:,} |" in l).split("|")[1:-1]]
        for offset, metric in ((3, "fid"), (7, "class_acc")):
            want = study_csv(step, metric)
            assert float(cells[offset].split(" ± ")[0]) == pytest.approx(float(want["baseline_mean"]), rel=1e-3)
            assert float(cells[offset + 1].split(" ± ")[0]) == pytest.approx(float(want["routed_mean"]), rel=1e-3)
            assert float(cells[offset + 3]) == pytest.approx(float(want["p_welch"]), rel=1e-2)


def test_equal_time_reads_dit_at_the_step_the_cost_part_gives():
    groups, rates, clock = token_table.pair(ARCHIVE)
    assert clock == "alone" and rates["tread"] > rates["dit"]
    text = "\n".join(token_table.table([(16, ARCHIVE)]))
    dit_step = float(re.search(r"dit step ([\d,]+), tread 3,000", text).group(1).replace(",", ""))
    assert dit_step == pytest.approx(3000 * rates["dit"] / rates["tread"], abs=1)


def test_a_bad_archive_is_one_line(tmp_path, capsys):
    for arg in ("sixteen=docs/results/runs", f"16={tmp_path / 'none'}"):
        with pytest.raises(SystemExit) as e:
            token_table.main([arg])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err and "TOKENS=FOLDER" in err


def test_the_committed_tables_are_the_archives_table(monkeypatch):
    """docs/results/tokens.md and the by-token-count table of docs/results.md are what the documented command
    gives on the committed archives."""
    monkeypatch.chdir(ROOT)  # the command's paths, relative to the checkout
    text = "\n".join(token_table.table([(16, Path("docs/results/runs")), (64, Path("docs/results/tokens64/runs"))]))
    rows = [line for line in text.split("\n") if line.startswith("| 16 |") or line.startswith("| 64 |")]
    assert len(rows) == 8
    assert (ROOT / "docs/results/tokens.md").read_text() == text
    section = (ROOT / "docs/results.md").read_text().split("## 6. By token count")[1].split("\n## ")[0]
    assert [line for line in section.split("\n") if line.startswith(("| 16 |", "| 64 |"))] == rows
