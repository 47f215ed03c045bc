"""lab/bench_diffusers.py on tiny sizes: a record with both architectures, a FLOP bound above 1, its table."""
import json

import pytest
import torch

pytest.importorskip("diffusers")
from lab import bench_diffusers  # noqa: E402


def test_bench_writes_a_record_and_table(tmp_path):
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--width", "64", "--depth", "4", "--tokens-side", "4", "--batch-size", "2", "--rounds", "1",
                          "--steps", "1", "--threads", str(torch.get_num_threads()), "--out", str(out)])
    record = json.loads(out.read_text())
    assert [r["arch"] for r in record["rows"]] == ["flux", "sd3"]
    for row in record["rows"]:
        assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0
        assert row["speedup_vs_bound"] == pytest.approx(row["speedup"] / row["flop_bound"])
    table = out.with_suffix(".md").read_text()
    assert "CPU cores shared with other jobs" in table and table.count("| flux |") == 1
