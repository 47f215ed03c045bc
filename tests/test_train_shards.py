"""train.py on latents on disk: it trains on extracted shards, and bad shards stop it with one line."""
import numpy as np
import pytest

from conftest import TINY_MODEL, assert_one_line_error, run_script
from test_shards import simple, write_tar

C, S, K = 4, 8, 10


def shard_train(tmp_path, data_dir, *extra):
    return run_script("train.py", f"results_dir={tmp_path / 'runs'}", "run_name=shards", "model=tread",
                      "dataset=imagenet256", f"dataset.train_path={data_dir}", f"dataset.input_size={S}",
                      f"dataset.num_classes={K}", *TINY_MODEL, "model.params.routes.0.start_layer_idx=1",
                      "model.params.routes.0.end_layer_idx=2", "train.general.batch_size=8",
                      "train.general.num_workers=2", "train.eval.eval_interval=0", "train.max_steps=6",
                      "train.ckpt_every=6", "train.logging.log_interval=3", *extra)


def test_trainer_reads_extracted_style_shards(tmp_path):
    # the extractor's layout: float16 [2 flips, 2C moments, S, S]
    write_tar(tmp_path / "data" / "latents-000000.tar", simple(12, (2, 2 * C, S, S)))
    write_tar(tmp_path / "data" / "latents-000001.tar", simple(12, (2, 2 * C, S, S), start=12))
    proc = shard_train(tmp_path, tmp_path / "data")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "runs" / "shards" / "checkpoints" / "ckpt_00000006.pt").exists()


@pytest.mark.parametrize("case", ["shape", "corrupt", "label", "empty"])
def test_bad_shards_are_one_clear_line(tmp_path, case):
    data = tmp_path / "data"
    write_tar(data / "good.tar", simple(16, (C, S, S)))
    if case == "shape":
        bad = write_tar(data / "bad.tar", simple(4, (C, S + 2, S)))
        needle = "bad.tar"
    elif case == "corrupt":
        bad = data / "bad.tar"
        bad.write_bytes(b"\x00garbage" * 100)
        needle = "bad.tar"
    elif case == "label":
        bad = write_tar(data / "bad.tar", [("000099", np.zeros((C, S, S), np.float16), 42)])
        needle = "label"
    else:
        (data / "good.tar").unlink()
        needle = "no"
    proc = shard_train(tmp_path, data)
    assert_one_line_error(proc, needle)
