"""bench.py's same-run comparison with the paper's code, against a stand-in for their repo.

The stand-in has their repo's shape: dit.py importing `Router` from its own routing_module.py (a
name this repo also uses), a `DiT_models` registry, a DiT whose forward calls
`router.get_mask(x, mask_ratio=...)` and a Router whose get_mask only takes `selection_rate`, the
mismatch of the published files."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import assert_one_line_error, run_script, save_tiny_vae
from dit import get_model  # imported before the stand-in, as in bench.py (the stand-in builds on it)
from tread_utils.errors import UserError
from lab.bench_training import paper_output_difference
from lab.paper_code import build_paper_model, load_our_weights, load_paper_dit

ROUTING = """
    CALLS = []

    class Router:
        def get_mask(self, x, selection_rate=0.0):
            CALLS.append(selection_rate)
            return selection_rate
"""

DIT = """
    import dit as ours
    from routing_module import CALLS, Router

    class DiT(ours.DiT):
        def __init__(self, enable_routing=False, routes=None, **kwargs):
            super().__init__(enable_routing=enable_routing, routes=routes, **kwargs)
            self.paper_router = Router()  # their attribute is `router`; ours is taken by our TokenRouter
            self.paper_routes, self.paper_routing = routes, enable_routing

        def forward(self, x, t, y, **kwargs):
            if self.training and self.paper_routing:
                self.paper_router.get_mask(x, mask_ratio=self.paper_routes[0]["selection_ratio"])
            return super().forward(x, t, y)

    # DiT-S/8, the authors' smallest (the GPU check's dry runs beside their code use it); DiT-T/8, ours, for speed
    DiT_models = {name: lambda name=name, **kw: DiT(**ours.DiT_models[name], **kw) for name in ("DiT-T/8", "DiT-S/8")}
"""


# A stand-in that differs from ours the way a DiT port easily does: the sin-cos position embedding with rows and
# columns swapped (pos_embed is the one tensor load_our_weights does not copy).
PERTURBED_DIT = DIT.replace("self.paper_routes, self.paper_routing = routes, enable_routing", """\
self.paper_routes, self.paper_routing = routes, enable_routing
            n, d = self.pos_embed.shape[1:]
            g = int(n ** 0.5)
            self.pos_embed = self.pos_embed.reshape(1, g, g, d).transpose(1, 2).reshape(1, n, d)""")


def write_paper_repo(folder, dit_source=DIT):
    folder.mkdir()
    (folder / "routing_module.py").write_text(textwrap.dedent(ROUTING))
    (folder / "dit.py").write_text(textwrap.dedent(dit_source))
    return folder


@pytest.fixture
def paper_repo(tmp_path):
    return write_paper_repo(tmp_path / "tread")


def test_paper_code_loads_beside_ours_and_accepts_mask_ratio(paper_repo):
    import routing_module

    paper = load_paper_dit(paper_repo)
    assert sys.modules["routing_module"] is routing_module  # ours is back in place
    model = build_paper_model(paper, "DiT-T/8", 12, routed=True, num_classes=10, in_channels=4, input_size=32)
    assert model.paper_routes == [dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=8)]
    model.train()(torch.randn(2, 4, 32, 32), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    assert sys.modules["tread_paper_routing_module"].CALLS == [0.5]  # mask_ratio arrived as selection_rate


def test_paper_code_weight_names_are_checked(paper_repo):
    paper = load_paper_dit(paper_repo)
    theirs = build_paper_model(paper, "DiT-T/8", 12, routed=False, num_classes=10, in_channels=4, input_size=32)
    load_our_weights(theirs, get_model("DiT-T/8", dict(num_classes=10, in_channels=4, input_size=32)))
    with pytest.raises(UserError, match="parameters differ from ours"):
        load_our_weights(theirs, get_model("DiT-T/4", dict(num_classes=10, in_channels=4, input_size=32)))
    with pytest.raises(UserError, match="parameter names differ from ours"):
        load_our_weights(theirs, get_model("DiT-T/8", dict(num_classes=10, in_channels=4, input_size=32, depth=2)))


def test_bench_times_ours_and_the_paper_code_in_one_run(paper_repo, tmp_path):
    out = tmp_path / "bench.json"
    run_script("lab.bench", "--backbones", "DiT-T/8", "--batch-sizes", "2", "--steps", "2", "--warmup", "1",
               "--sections", "training", "--paper-code", paper_repo, "--out", out, check=True)
    rows = json.loads(out.read_text())["training"]
    variants = [(r["code"], r["mode"], r["model"]) for r in rows]
    assert variants == [(code, mode, model) for code, mode in
                        [("ours", "eager"), ("paper", "published"), ("paper", "eager")] for model in ("dit", "tread")]
    for r in rows:
        assert r["step_s"] > 0 and r["flops_per_step"] > 0
        if r["code"] == "paper":
            assert r["max_abs_output_difference"] == 0.0  # the stand-in computes our exact function
    step_s = {(r["code"], r["mode"], r["model"]): r["step_s"] for r in rows}
    for r in rows:  # TREAD's speed-up is the dense step time of the same code and mode over its own
        if r["model"] == "tread":
            assert r["speedup"] == step_s[r["code"], r["mode"], "dit"] / r["step_s"]
            assert r["speedup_vs_bound"] == r["speedup"] / r["flop_bound"]
    table = out.with_suffix(".md").read_text()
    assert "| DiT-T/8 | 2 | tread |" in table and "paper / ours" in table


def test_bench_compiles_each_block_static_with_compile_dynamic_false(tmp_path, monkeypatch):
    """--compile-dynamic false (train.compile_dynamic=false) per block: `tread` compiles one static graph per
    shape and layout, four for its blocks (the first blocks, the routed ones, the float32 block, the blocks after
    the route) and the final layer's, where torch's default compiles three block graphs, two of them dynamic
    (tests/test_compile_scope.py); `dit` one and the final layer's; the row and the table say so."""
    from lab import bench

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--backbones", "DiT-T/8", "--batch-sizes", "2", "--steps", "1",
                                      "--warmup", "1", "--sections", "training", "--compile", "--compile-backend",
                                      "eager", "--compile-scope", "blocks", "--compile-dynamic", "false", "--dtype",
                                      "bf16", "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["training"]
    assert [(r["model"], r["compile_dynamic"], r["graphs"]) for r in rows] == [("dit", False, 2), ("tread", False, 5)]
    assert "| compiled (blocks, static shapes) |" in out.with_suffix(".md").read_text()


def test_a_paper_code_computing_another_function_is_detected(tmp_path):
    """The output comparison really compares two models: a stand-in with a swapped position embedding shows
    a clear difference (the faithful one shows none: test_bench_times_ours_and_the_paper_code_in_one_run)."""
    perturbed = load_paper_dit(write_paper_repo(tmp_path / "perturbed", PERTURBED_DIT))
    assert paper_output_difference(perturbed, "DiT-T/8") > 1e-2


def test_bench_suite_section_times_the_evaluator_and_reads_its_peak_memory(tmp_path, monkeypatch, capsys):
    """The suite section writes ADM-layout random batches, runs the evaluator CLI on them in its measuring
    wrapper and reads the wrapper's peak-memory line. The evaluator itself runs end to end in
    test_evaluator_cli (its two 2048-dim matrix square roots take a minute on 2 cores), so here the wrapper
    runs for real on `--help` (the line is printed at any exit) and the section's child gets its output."""
    from lab import bench_evaluation

    wrapper = subprocess.run([sys.executable, "-c", bench_evaluation._MEASURED_EVALUATOR, "--help"],
                             cwd=bench_evaluation.REPO, capture_output=True, text=True, timeout=120)
    assert wrapper.returncode == 0 and "usage: evaluator" in wrapper.stdout, wrapper.stderr
    peak = [line for line in wrapper.stderr.splitlines() if line.startswith("peak_rss_mb")]
    assert len(peak) == 1 and float(peak[0].split()[1]) > 10
    seen = {}

    class Child:
        """The evaluator's process as bench_suite reads it: output lines, then an exit code."""

        def __init__(self, cmd, **kwargs):
            ref, samples = cmd[3:5]
            seen.update(cmd=cmd, kwargs=kwargs, shapes=[np.load(f)["arr_0"].shape for f in (ref, samples)])
            self.stdout, self.returncode = iter(["samples:  50%|#####     | 4/8\n", "FID: 1.0\n", peak[0] + "\n"]), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench_evaluation.subprocess, "Popen", Child)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--sections", "suite", "--suite-samples", "8", "--suite-ref", "4",
                                      "--suite-batch", "4", "--tmp-dir", str(tmp_path), "--out", str(out)])
    from lab import bench

    bench.main()
    assert seen["shapes"] == [(4, 256, 256, 3), (8, 256, 256, 3)]
    assert seen["cmd"][:3] == [sys.executable, "-c", bench_evaluation._MEASURED_EVALUATOR]
    assert seen["cmd"][5:-1] == ["--random-init", "--batch-size", "4", "--device"]  # progress relayed, not hidden
    assert seen["kwargs"]["stderr"] == subprocess.STDOUT and seen["kwargs"]["env"]["PYTHONUNBUFFERED"] == "1"
    suite, = json.loads(out.read_text())["suite"]
    assert suite["samples"] == 8 and suite["seconds"] > 0 and suite["peak_host_mb"] == float(peak[0].split()[1])
    assert suite["stages_done"] == ["writing", "evaluator"] and suite["writing_s"] > 0
    relayed = capsys.readouterr().out
    assert "  evaluator: samples:  50%" in relayed and "  evaluator: FID: 1.0" in relayed
    assert list(tmp_path.glob("tmp*")) == []  # the random batches are removed
    assert "ADM suite" in out.with_suffix(".md").read_text()


def test_bench_metric_and_fid_sections_time_each_stage(tmp_path, monkeypatch, capsys):
    """The metrics and fid sections in-process, with the 2048 x 2048 matrix square roots (half a minute each
    on 2 cores; the real ones run in the suite test above and in test_evaluator_cli) replaced by recorders.
    The metric stage's child-process code is executed as written; the fid section decodes with a tiny VAE
    folder through the real loading code."""
    from lab import bench, bench_evaluation, bench_memory

    seen = {}
    monkeypatch.setattr(bench_memory, "score_features", lambda feats, ref, device: seen.update(
        metrics=(feats["pool"].shape, sorted(feats), ref["pool"].shape, ref["sigma"].shape)))
    monkeypatch.setattr(bench_evaluation, "frechet_distance",
                        lambda mu1, sigma1, mu2, sigma2: seen.update(fid=(mu1.shape, sigma2.shape)) or 0.0)

    def child(cmd, **kwargs):
        assert cmd[:2] == [sys.executable, "-c"]
        capsys.readouterr()
        exec(cmd[2], {})  # the code the child process would run; it prints the stage's JSON line
        return subprocess.CompletedProcess(cmd, 0, capsys.readouterr().out, "")

    monkeypatch.setattr(bench_evaluation.subprocess, "run", child)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--backbones", "DiT-T/8", "--sections", "metrics", "fid",
                                      "--suite-samples", "8", "--suite-ref", "4", "--fid-samples", "2",
                                      "--fid-steps", "2", "--fid-batch", "2",
                                      "--vae", save_tiny_vae(tmp_path / "vae", 64), "--out", str(out)])
    bench.main()
    # as the evaluator holds them: pool features, the logits already reduced to IS, sFID's to statistics
    assert seen == {"metrics": ((8, 2048), ["inception_score", "pool", "spatial_stats"], (4, 2048), (2048, 2048)),
                    "fid": ((2048,), (2048, 2048))}
    result = json.loads(out.read_text())
    metrics, = result["metrics"]
    assert metrics["samples"] == 8 and metrics["reference"] == 4 and metrics["peak_host_mb"] > 100
    fid, = result["fid"]
    assert fid["samples"] == 2 and min(fid[k] for k in ("sampling_s", "decoding_s", "features_s")) > 0
    assert fid["seconds"] >= fid["sampling_s"] + fid["decoding_s"] + fid["features_s"]
    assert fid["stages_done"] == ["sampling", "decoding", "features", "statistics", "distance"]
    md = out.with_suffix(".md").read_text()
    assert "ADM metric stage alone" in md and "In-training FID" in md


@pytest.mark.parametrize("make_bad, needle", [
    (lambda p: p / "missing", "no dit.py"),
    (lambda p: (p / "routing_module.py").unlink() or p, "no routing_module.py"),
    (lambda p: (p / "dit.py").write_text("import not_a_module\n") and p, "importing"),
])
def test_bench_rejects_a_bad_paper_code_folder(paper_repo, make_bad, needle):
    proc = run_script("lab.bench", "--backbones", "DiT-T/8", "--sections", "training",
                      "--paper-code", make_bad(paper_repo))
    assert_one_line_error(proc, needle)


def test_bench_rejects_an_unknown_backbone():
    assert_one_line_error(run_script("lab.bench", "--backbones", "DiT-Q/2"), "unknown backbone")


def test_position_embedding_has_dits_layout():
    """DiT/MAE put the column (w) coordinate in the first half of the sin-cos dims: weights and outputs
    then match DiT-family code (the paper's dit.py) exactly."""
    from dit import sincos_pos_embed_2d

    emb = sincos_pos_embed_2d(8, 4).reshape(4, 4, 8)  # [row, col, dim]
    first, second = emb[..., :4], emb[..., 4:]
    assert torch.equal(first[0], first[3]) and not torch.equal(first[:, 0], first[:, 1])  # first half: column
    assert torch.equal(second[:, 0], second[:, 3]) and not torch.equal(second[0], second[1])  # second: row
    np.testing.assert_allclose(emb[0, 1, :2].numpy(), [np.sin(1.0), np.sin(0.01)], rtol=1e-6)


def test_bench_loader_section_writes_samples_per_second(tmp_path, monkeypatch):
    """`--sections loader` without --loader-path writes its own tiny shards and times the trainer's loader."""
    from lab import bench

    out = tmp_path / "loader.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--sections", "loader", "--loader-samples", "48", "--loader-batch", "4",
                                      "--loader-batches", "3", "--loader-workers", "2", "--loader-shape", "2", "4", "5",
                                      "--out", str(out)])
    bench.main()
    row, = json.loads(out.read_text())["loader"]
    assert row["workers"] == 2 and row["batch"] == 4 and row["samples"] == 12 and row["dataset_size"] == 48
    assert row["samples_per_s"] > 0 and row["first_batch_s"] > 0
    assert "samples/s" in out.with_suffix(".md").read_text()


def test_training_table_names_a_kernel_other_than_torchs_choice():
    """The same variant timed with --attention-fp32 math, --attention flash4 or --compile-dynamic false reads apart
    from the default one."""
    from lab.bench_tables import training_table

    row = dict(backbone="DiT-XL/2", batch=256, micro_batch=128, code="ours", mode="compiled", compile_scope="blocks",
               model="tread", fp32_after_route=True, step_s=0.317, warmup_s=17.6, images_per_s=806.7,
               peak_mem_mb=35212.5, flops_per_step=1.06e14, mfu=0.486, speedup=1.545, flop_bound=1.716,
               speedup_vs_bound=0.900, attention="sdpa", attention_fp32="sdpa")
    rows = [row, dict(row, attention_fp32="math"), dict(row, attention="flash4", fp32_after_route=False)]
    lines = training_table(rows, "NVIDIA H100", "bf16", 7.9e14).splitlines()[-3:]
    assert [line.split(" | ")[4] for line in lines] == [
        "tread", "tread, float32 attention math", "tread, bf16 after route, attention flash4"]
    static = training_table([dict(row, compile_dynamic=False)], "NVIDIA H100", "bf16", 7.9e14).splitlines()[-1]
    assert static.split(" | ")[3] == "compiled (blocks, static shapes)"  # --compile-dynamic false
