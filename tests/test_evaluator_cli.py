"""The ADM evaluator CLI and fid.py: five output lines, reference statistics, bad inputs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import projection_extractor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fid as fid_cli  # noqa: E402
from evaluations import evaluator, inception_weights  # noqa: E402
from evaluations.evaluator import evaluate, metrics_from_features  # noqa: E402
from data.images import latents_to_uint8  # noqa: E402
from evaluations.features import NpzImages, compute_features  # noqa: E402
from evaluations.metrics import feature_statistics, frechet_distance  # noqa: E402

FIVE_LINES = [r"Inception Score: \S+", r"FID: \S+", r"sFID: \S+", r"Precision: \S+", r"Recall: \S+"]


def _offline_env(tmp_path, **extra):
    env = dict(os.environ)
    env.pop(inception_weights.WEIGHTS_ENV, None)
    # one thread: on a shared 2-core machine, oversubscribed torch/BLAS threads are several times slower
    env.update({"TORCH_HOME": str(tmp_path / "torch"), "HOME": str(tmp_path), inception_weights.OFFLINE_ENV: "1",
                "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, **extra)
    return env


def _run(args, tmp_path, **extra_env):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_offline_env(tmp_path, **extra_env),
                          capture_output=True, text=True, timeout=300)


def _images(n, h=24, w=20, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.fixture
def batches(tmp_path):
    ref, sample = tmp_path / "ref.npz", tmp_path / "sample.npz"
    np.savez(ref, arr_0=_images(6, seed=1))
    np.savez(sample, arr_0=_images(5, seed=2), arr_1=np.arange(5))
    return ref, sample


def test_evaluator_prints_five_lines_with_random_init(batches, tmp_path):
    """End to end as a subprocess. The reference carries precomputed statistics (used instead of its
    images' statistics) with zero covariances, so FID = |mu - mu_ref|^2 + tr(sigma) is known exactly
    without a matrix square root, and scipy's sqrtm of 2048x2048 zeros stays cheap; its images give
    precision/recall."""
    from evaluations.inception import random_init_inception
    from evaluations.metrics import inception_score

    ref, sample = batches
    rng = np.random.default_rng(0)
    stats = {"mu": rng.random(2048), "sigma": np.zeros((2048, 2048)),
             "mu_s": rng.random(2023), "sigma_s": np.zeros((2023, 2023))}
    np.savez(ref, arr_0=_images(6, seed=1), **stats)
    proc = _run(["evaluations/evaluator.py", str(ref), str(sample), "--random-init", "--batch-size", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 5, proc.stdout
    for line, pattern in zip(lines, FIVE_LINES):
        assert re.fullmatch(pattern, line), line
    values = [float(line.split(": ")[1]) for line in lines]
    assert all(np.isfinite(values))
    # the same numbers in-process, with the same seeded network
    feats = compute_features(random_init_inception(seed=0), np.load(sample)["arr_0"], batch_size=4)
    expected_fid = np.sum((feats["pool"].mean(0) - stats["mu"]) ** 2) + np.trace(np.cov(feats["pool"], rowvar=False))
    expected_sfid = (np.sum((feats["spatial"].mean(0) - stats["mu_s"]) ** 2)
                     + np.trace(np.cov(feats["spatial"], rowvar=False)))
    assert values[0] == pytest.approx(inception_score(feats["logits"]), rel=1e-4)
    assert values[1] == pytest.approx(expected_fid, rel=1e-4)
    assert values[2] == pytest.approx(expected_sfid, rel=1e-4)
    assert 0.0 <= values[3] <= 1.0 and 0.0 <= values[4] <= 1.0


# ---------------------------------------------------------------------------------------------
# bad inputs: one `error:` line, exit code 2, no traceback
# ---------------------------------------------------------------------------------------------
def _expect_user_error(capsys, main, argv, match):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(match, err), err


def _bad_input_cases(tmp_path, batches):
    ref, sample = batches
    cases = []

    def npz(name, **arrays):
        path = tmp_path / name
        np.savez(path, **arrays)
        return str(path)

    cases.append(([str(ref), npz("no_arr0.npz", images=_images(5))], r"no 'arr_0'"))
    cases.append(([str(ref), npz("float.npz", arr_0=_images(5).astype(np.float32))], r"dtype float32.*uint8"))
    nan = _images(5).astype(np.float32)
    nan[0, 0, 0, 0] = np.nan
    cases.append(([str(ref), npz("nan.npz", arr_0=nan)], r"NaN or inf"))
    cases.append(([str(ref), npz("grey.npz", arr_0=_images(5)[..., 0])], r"shape \(5, 24, 20\).*\[N, H, W, 3\]"))
    cases.append(([str(ref), npz("nchw.npz", arr_0=_images(5).transpose(0, 3, 1, 2))], r"expected \[N, H, W, 3\]"))
    cases.append(([str(ref), str(sample), "--num-samples", "50"], r"5 sample images, fewer than the 50"))
    cases.append(([npz("empty_ref.npz", labels=np.arange(3)), str(sample)], r"neither statistics .* nor images"))
    mu_nan = np.zeros(2048)
    mu_nan[3] = np.inf
    cases.append(([npz("inf_stats.npz", mu=mu_nan, sigma=np.eye(2048)), str(sample)], r"'mu' contains NaN or inf"))
    cases.append(([npz("half_stats.npz", mu=np.zeros(2048)), str(sample)], r"'mu' but not 'sigma'"))
    cases.append(([npz("small_stats.npz", mu=np.zeros(5), sigma=np.eye(5)), str(sample)], r"'mu' has shape \(5,\)"))
    text = tmp_path / "notes.npz"
    text.write_text("not a zip file\n")
    cases.append(([str(ref), str(text)], r"not an \.npz"))
    cases.append(([str(tmp_path / "missing.npz"), str(sample)], r"no such file"))
    cases.append(([str(ref), npz("small.npz", arr_0=_images(5, h=12, w=10))],
                  r"reference of 24x20 images, the samples are 12x10"))
    cases.append(([npz("sized_stats.npz", mu=np.zeros(2048), sigma=np.eye(2048), image_size=np.array([64, 64])),
                   str(sample)], r"reference of 64x64 images, the samples are 24x20"))
    return cases


def test_evaluator_bad_inputs_in_process(tmp_path, batches, capsys):
    for argv, match in _bad_input_cases(tmp_path, batches):
        _expect_user_error(capsys, evaluator.main, argv + ["--random-init"], match)


def test_evaluator_weights_missing_offline_in_process(tmp_path, batches, capsys, monkeypatch):
    for key, value in _offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(inception_weights.WEIGHTS_ENV, raising=False)
    ref, sample = batches
    _expect_user_error(capsys, evaluator.main, [str(ref), str(sample)],
                       re.escape(inception_weights.WEIGHTS_FILENAME) + ".*" + re.escape(inception_weights.WEIGHTS_URL))


@pytest.mark.parametrize("case", ["not_npz", "weights_offline", "tf_backend"])
def test_evaluator_bad_inputs_as_subprocess(case, tmp_path, batches):
    ref, sample = batches
    if case == "not_npz":
        bad = tmp_path / "x.npz"
        bad.write_bytes(b"\x00\x01garbage")
        args, match = [str(ref), str(bad)], r"not an \.npz"
    elif case == "weights_offline":
        args, match = [str(ref), str(sample)], re.escape(inception_weights.WEIGHTS_FILENAME) + ".*--weights"
    else:
        try:
            import tensorflow  # noqa: F401
            pytest.skip("tensorflow is installed")
        except ImportError:
            pass
        args, match = [str(ref), str(sample), "--backend", "tf"], re.escape('pip install -e ".[tf]"')
    proc = _run(["evaluations/evaluator.py", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(match, err[0]), proc.stderr
    assert proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# evaluate(): precomputed statistics win, statistics-only references, fast fake extractor
# ---------------------------------------------------------------------------------------------
TINY_DIMS = {"pool": 12, "spatial": 6, "logits": 5}


def test_evaluate_uses_precomputed_reference_statistics(tmp_path):
    ext = projection_extractor(TINY_DIMS)
    ref_images, sample_images = _images(40, seed=3), _images(30, seed=4)
    given = {"mu": np.full(12, 0.5), "sigma": np.eye(12) * 0.2, "mu_s": np.zeros(6), "sigma_s": np.eye(6)}
    np.savez(tmp_path / "ref.npz", arr_0=ref_images, **given)
    np.savez(tmp_path / "sample.npz", arr_0=sample_images)
    result = evaluate(tmp_path / "ref.npz", tmp_path / "sample.npz", ext, batch_size=7, progress=False)
    sample_feats = compute_features(ext, sample_images, batch_size=7)
    mu, sigma = feature_statistics(sample_feats["pool"])
    assert result["fid"] == pytest.approx(frechet_distance(mu, sigma, given["mu"], given["sigma"]), rel=1e-6)
    mu_s, sigma_s = feature_statistics(sample_feats["spatial"])
    assert result["sfid"] == pytest.approx(frechet_distance(mu_s, sigma_s, given["mu_s"], given["sigma_s"]), rel=1e-9)
    assert 0 <= result["precision"] <= 1 and 0 <= result["recall"] <= 1  # from the reference images
    # --num-samples: the first N
    first = evaluate(tmp_path / "ref.npz", tmp_path / "sample.npz", ext, batch_size=7, num_samples=10, progress=False)
    mu10, sigma10 = feature_statistics(sample_feats["pool"][:10])
    assert first["fid"] == pytest.approx(frechet_distance(mu10, sigma10, given["mu"], given["sigma"]), rel=1e-6)


def test_evaluate_computes_reference_statistics_from_images(tmp_path):
    ext = projection_extractor(TINY_DIMS)
    ref_images, sample_images = _images(25, seed=7), _images(20, seed=8)
    np.savez(tmp_path / "ref.npz", arr_0=ref_images)
    np.savez(tmp_path / "sample.npz", arr_0=sample_images)
    result = evaluate(tmp_path / "ref.npz", tmp_path / "sample.npz", ext, batch_size=64, progress=False)
    ref_feats, sample_feats = compute_features(ext, ref_images), compute_features(ext, sample_images)
    for key, metric in (("pool", "fid"), ("spatial", "sfid")):
        expected = frechet_distance(*feature_statistics(sample_feats[key]), *feature_statistics(ref_feats[key]))
        assert result[metric] == pytest.approx(expected, rel=1e-9)
    from evaluations.metrics import precision_recall

    assert (result["precision"], result["recall"]) == precision_recall(ref_feats["pool"], sample_feats["pool"])
    same = evaluate(tmp_path / "ref.npz", tmp_path / "ref.npz", ext, progress=False)
    assert abs(same["fid"]) < 1e-6 and same["precision"] == 1.0 and same["recall"] == 1.0
    ref = evaluator.reference_from_npz(tmp_path / "ref.npz", ext, progress=False)
    assert evaluator.fid_against_reference(ext, torch.from_numpy(sample_images), ref) == pytest.approx(
        result["fid"], rel=1e-9)


def test_statistics_only_reference_gives_nan_precision_recall_with_note(tmp_path):
    ext = projection_extractor(TINY_DIMS)
    feats = compute_features(ext, _images(20, seed=5))
    ref = {"mu": feats["pool"].mean(0), "sigma": np.cov(feats["pool"], rowvar=False)}
    np.savez(tmp_path / "ref.npz", **ref)
    np.savez(tmp_path / "sample.npz", arr_0=_images(20, seed=5))
    result = evaluate(tmp_path / "ref.npz", tmp_path / "sample.npz", ext, progress=False)
    assert abs(result["fid"]) < 1e-6  # same images as the reference
    assert np.isnan(result["precision"]) and np.isnan(result["recall"]) and np.isnan(result["sfid"])
    assert any("Precision/Recall" in n for n in result["notes"])
    direct = metrics_from_features(feats, {**ref, "pool": feats["pool"]})
    assert direct["precision"] == 1.0 and direct["recall"] == 1.0


def test_npz_images_streams_in_batches(tmp_path):
    images = _images(11, seed=6)
    np.savez_compressed(tmp_path / "c.npz", arr_0=images)
    reader = NpzImages(tmp_path / "c.npz")
    assert len(reader) == 11 and reader.dtype == np.uint8
    parts = list(reader.batches(4))
    assert [len(p) for p in parts] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate(parts), images)
    np.testing.assert_array_equal(reader.read(limit=5), images[:5])


def test_latents_to_uint8():
    x = torch.tensor([-1.0, -2.0, 0.0, 1.0, 3.0, 0.5]).view(1, 1, 2, 3)
    out = latents_to_uint8(x)
    assert out.dtype == torch.uint8 and out.shape == (1, 2, 3, 3)
    assert out[0, ..., 0].flatten().tolist() == [0, 0, 128, 255, 255, 191]
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])
    assert isinstance(latents_to_uint8(x.numpy()), np.ndarray)


# ---------------------------------------------------------------------------------------------
# fid.py (digits network: fast)
# ---------------------------------------------------------------------------------------------
def _digit_pngs(folder, n=30, start=0):
    from PIL import Image

    from data.digits import load_digits_split

    folder.mkdir(parents=True, exist_ok=True)
    images = latents_to_uint8(load_digits_split("test")[0][start:start + n]).numpy()
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:04d}.png")
    return images


def test_fid_cli_ref_and_calc(tmp_path):
    images = _digit_pngs(tmp_path / "pngs", n=200)  # more images than feature dims: full-rank covariance
    np.savez(tmp_path / "imgs.npz", arr_0=images)
    out = tmp_path / "ref.npz"
    proc = _run(["fid.py", "ref", "--images", str(tmp_path / "pngs"), "--out", str(out), "--network", "digits",
                 "--save-features", "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as ref:
        assert {"mu", "sigma", "mu_s", "sigma_s", "pool_features"} <= set(ref.files)
        assert ref["mu"].shape == (128,) and ref["sigma"].shape == (128, 128)
        assert ref["image_size"].tolist() == list(images.shape[1:3])
    proc = _run(["fid.py", "calc", "--images", str(tmp_path / "imgs.npz"), "--ref", str(out), "--network", "digits",
                 "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert re.fullmatch(r"FID: \S+", line) and abs(float(line.split()[1])) < 1e-6  # lossless PNG round trip


def test_fid_cli_bad_inputs(tmp_path, capsys):
    images = _digit_pngs(tmp_path / "pngs", n=6)
    (tmp_path / "empty").mkdir()
    _expect_user_error(capsys, fid_cli.main, ["ref", "--images", str(tmp_path / "empty"), "--out",
                                              str(tmp_path / "r.npz"), "--network", "digits"], r"no \.png/\.jpg")
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "pngs" / "odd.png")
    _expect_user_error(capsys, fid_cli.main, ["ref", "--images", str(tmp_path / "pngs"), "--out",
                                              str(tmp_path / "r.npz"), "--network", "digits"], r"one size")
    np.savez(tmp_path / "imgs.npz", arr_0=images)
    _expect_user_error(capsys, fid_cli.main, ["calc", "--images", str(tmp_path / "imgs.npz"), "--ref",
                                              str(tmp_path / "imgs.npz"), "--network", "digits",
                                              "--num-images", "7"], r"fewer than the 7")
    np.savez(tmp_path / "incep.npz", mu=np.zeros(2048), sigma=np.eye(2048), feature_network=np.array("inception"))
    _expect_user_error(capsys, fid_cli.main, ["calc", "--images", str(tmp_path / "imgs.npz"), "--ref",
                                              str(tmp_path / "incep.npz"), "--network", "digits"], r"--network inception")
    np.savez(tmp_path / "big.npz", mu=np.zeros(128), sigma=np.eye(128), image_size=np.array([32, 32]))
    _expect_user_error(capsys, fid_cli.main, ["calc", "--images", str(tmp_path / "imgs.npz"), "--ref",
                                              str(tmp_path / "big.npz"), "--network", "digits"],
                       r"reference of 32x32 images, the --images are 16x16")


def test_fid_cli_ref_never_writes_over_images(tmp_path, capsys):
    """--out naming the --images batch, or another image batch, is refused before anything is computed; the
    images are left as they were."""
    import hashlib

    images = _digit_pngs(tmp_path / "pngs", n=6)
    np.savez(tmp_path / "s.npz", arr_0=images)
    np.savez(tmp_path / "other.npz", arr_0=images[:3])
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "s.npz", tmp_path / "other.npz")}
    _expect_user_error(capsys, fid_cli.main, ["ref", "--images", str(tmp_path / "s.npz"), "--out",
                                              str(tmp_path / "s.npz"), "--network", "digits", "--random-init"],
                       r"is the --images file: writing the statistics there would replace the images")
    _expect_user_error(capsys, fid_cli.main, ["ref", "--images", str(tmp_path / "pngs"), "--out",
                                              str(tmp_path / "other.npz"), "--network", "digits"],
                       r"holds an image batch \(arr_0\), not statistics")
    assert digest == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in digest}
