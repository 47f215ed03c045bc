"""A model size registered in a user's own module, as docs/extensions.md's table says: one entry of
`dit.DiT_models`, seen by the FLOP report and by train.py through the config key `imports`, with nothing of
ours edited."""
import subprocess
import sys
import textwrap

from conftest import REPO, TINY_TRAIN, assert_one_line_error, subprocess_env

SIZES = textwrap.dedent("""\
    import dit

    dit.DiT_models["DiT-Mine/4"] = dict(depth=12, hidden_size=32, num_heads=2, patch_size=4)
""")


def run(tmp_path, *args):
    """A command run from the user's folder, which holds their module."""
    (tmp_path / "my_sizes.py").write_text(SIZES)
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)


def test_the_flop_report_counts_a_size_registered_in_the_users_module(tmp_path):
    report = run(tmp_path, "-m", "training.flops", "imports=[my_sizes]", "model.backbone_type=DiT-Mine/4")
    assert report.returncode == 0, report.stderr
    assert "FLOPs per training step (DiT-Mine/4, batch 1" in report.stdout
    assert "tokens per block [16, 16, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16]" in report.stdout  # 12 blocks, route 2 -> 8
    assert_one_line_error(run(tmp_path, "-m", "training.flops", "model.backbone_type=DiT-Mine/4"), "DiT-Mine/4")


def test_train_builds_a_size_registered_in_the_users_module(tmp_path):
    result = run(tmp_path, str(REPO / "train.py"), "imports=[my_sizes]",
                 "model.backbone_type=DiT-Mine/4", f"results_dir={tmp_path / 'results'}", "run_name=mine",
                 "model=tread", *TINY_TRAIN, "train.max_steps=1", "train.ckpt_every=1", "train.eval.eval_interval=0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DiT-Mine/4" in result.stdout
