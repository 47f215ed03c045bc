"""extract_latents.py and data/vae.py on a tiny random AutoencoderKL: shards, ranks, resume, errors, MaskDiT."""
import glob
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import save_tiny_vae
from data import extract_latents as xl
from data import shard_writer as sw
from data.shards import LatentShardDataset
from data.vae import SD_VAE_SCALE, decode_latents, encode_moments, load_sd_vae, vae_downsample_factor
from tools.make_random_sdvae import SD_VAE_CONFIG, write_images
from tread_utils.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RES, LAT = 32, 16  # the tiny VAE downsamples by 2
FLAGS = ["--resolution", str(RES), "--shard-size", "4", "--num-workers", "0", "--batch-size", "3", "--cpu"]


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    return save_tiny_vae(tmp_path_factory.mktemp("vae"), RES)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """3 classes x 4 RGB images of assorted sizes, plus a grey-scale, an RGBA and a corrupt file."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.RandomState(0)
    for c, name in enumerate(["n01", "n02", "n03"]):
        os.makedirs(root / name)
        for i in range(4):
            shape = (RES + 9 * i, 2 * RES + 5 * c, 3) if i % 2 else (3 * RES + 7, RES + 3 * i, 3)
            Image.fromarray(rng.randint(0, 256, shape, dtype=np.uint8)).save(root / name / f"img{i}.png")
    Image.fromarray(rng.randint(0, 256, (50, 40), dtype=np.uint8)).save(root / "n01" / "grey.png")
    Image.fromarray(rng.randint(0, 256, (40, 50, 4), dtype=np.uint8)).save(root / "n02" / "rgba.png")
    (root / "n03" / "broken.jpg").write_bytes(b"\xff\xd8 this is no jpeg")
    (root / "n03" / "notes.txt").write_text("not an image, ignored")
    return str(root)


def read_shards(out):
    """{key: (label, latent float16 array)} over all tars of `out`, asserting keys are unique."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "*.tar"))):
        with tarfile.open(path) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf}
        for name, data in members.items():
            if name.endswith(".latent.npy"):
                key = name[: -len(".latent.npy")]
                assert key not in found, f"duplicate sample {key}"
                found[key] = (int(members[key + ".cls"]), np.load(io.BytesIO(data)))
    return found


@pytest.fixture(scope="module")
def single_run(tiny_vae, images, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single") / "out")
    xl.main([images, out, "--vae", tiny_vae, *FLAGS])
    return out


def test_single_process_shards_manifest_and_reader(single_run, images):
    manifest = json.load(open(os.path.join(single_run, "manifest.json")))
    assert manifest["num_samples"] == 14 and manifest["num_classes"] == 3
    assert manifest["class_counts"] == [5, 5, 4] and manifest["classes"] == ["n01", "n02", "n03"]
    assert manifest["scale_factor"] == SD_VAE_SCALE and manifest["latent_shape"] == [2, 8, LAT, LAT]
    assert manifest["resolution"] == RES and [s["count"] for s in manifest["shards"]] == [4, 4, 3, 3]
    assert [s["path"] for s in manifest["skipped"]] == [os.path.join("n03", "broken.jpg")]
    samples = read_shards(single_run)
    assert len(samples) == 14
    labels = {key: y for key, (y, _) in samples.items()}
    assert labels["00000000"] == 0 and labels["00000005"] == 1 and labels["00000013"] == 2  # sorted item order
    assert "00000010" not in labels  # n03/broken.jpg is item 10
    for y, z in samples.values():
        assert z.shape == (2, 8, LAT, LAT) and z.dtype == np.float16 and np.isfinite(z).all()
    assert not glob.glob(os.path.join(single_run, "*.partial"))
    ds = LatentShardDataset(single_run, 4, LAT, 3)
    assert len(ds) == 14 and ds[13][0].shape == (4, LAT, LAT) and ds[13][1] == 2
    import webdataset as wds  # the official loader reads the shards too

    first = next(iter(wds.WebDataset(sorted(glob.glob(os.path.join(single_run, "*.tar"))), shardshuffle=False).decode()))
    assert first["__key__"] == "00000000" and first["cls"] == 0 and first["latent.npy"].shape == (2, 8, LAT, LAT)


def test_flip_half_is_the_encoded_mirror(single_run, tiny_vae, images):
    vae = load_sd_vae(tiny_vae)
    with Image.open(os.path.join(images, "n01", "grey.png")) as im:
        arr = xl.center_crop_arr(im.convert("RGB"), RES)
    assert arr.shape == (RES, RES, 3)
    x = torch.from_numpy(np.array(arr)).permute(2, 0, 1)[None].float() / 127.5 - 1
    mean, logvar = encode_moments(vae, torch.cat([x, x.flip(-1)]))
    stored = read_shards(single_run)["00000000"][1].astype(np.float32)  # n01/grey.png sorts first
    np.testing.assert_allclose(stored[0, :4], mean[0].numpy(), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(stored[1, 4:], logvar[1].numpy(), atol=2e-2, rtol=2e-3)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(single_run, tiny_vae, images, tmp_path):
    out = str(tmp_path / "out2")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "data.extract_latents", images, out, "--vae", tiny_vae, *FLAGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1/2" in proc.stdout and "rank 0/2" in proc.stdout  # really two processes
    one, two = read_shards(single_run), read_shards(out)
    assert sorted(one) == sorted(two)
    for key in one:
        assert one[key][0] == two[key][0]
        np.testing.assert_allclose(one[key][1].astype(np.float32), two[key][1].astype(np.float32), atol=2e-3, rtol=2e-3)
    assert json.load(open(os.path.join(out, "manifest.json")))["num_samples"] == 14


def test_ranks_write_only_their_shards(tiny_vae, images, tmp_path):
    vae = load_sd_vae(tiny_vae)
    kw = dict(vae=vae, vae_id="tiny", resolution=RES, shard_size=4, batch_size=4, num_workers=0, progress=False)
    out = str(tmp_path / "out")
    xl.run_extraction(images, out, rank=1, world_size=2, **kw)
    assert sorted(os.listdir(out)) == [".progress", "latents-000001.tar", "latents-000003.tar"]
    with pytest.raises(UserError) as e:  # rank 0 has not finished: no manifest
        sw.write_manifest(out)
    assert "not complete" in str(e.value)
    xl.run_extraction(images, out, rank=0, world_size=2, **kw)
    assert sw.write_manifest(out)["num_samples"] == 14 and len(read_shards(out)) == 14


def test_interrupted_run_resumes_without_duplicates(single_run, tiny_vae, images, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    finish, calls = sw.ShardWriter.finish, []

    def crash_on_second_shard(self):
        calls.append(self.k)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while the second shard is still being written
        finish(self)

    monkeypatch.setattr(sw.ShardWriter, "finish", crash_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        xl.main([images, out, "--vae", tiny_vae, *FLAGS])
    monkeypatch.setattr(sw.ShardWriter, "finish", finish)
    assert os.path.isfile(os.path.join(out, "latents-000000.tar"))
    assert os.path.isfile(os.path.join(out, "latents-000001.tar.partial"))  # half-written, not a .tar
    assert not os.path.exists(os.path.join(out, "latents-000001.tar"))
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert len(LatentShardDataset(out, 4, LAT, 3)) == 4  # a reader only ever sees complete shards
    mtime = os.path.getmtime(os.path.join(out, "latents-000000.tar"))
    capsys.readouterr()
    xl.main([images, out, "--vae", tiny_vae, *FLAGS])
    assert "3 of 4 shards to encode (1 already complete)" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(out, "latents-000000.tar")) == mtime  # not re-encoded
    assert not glob.glob(os.path.join(out, "*.partial"))
    resumed, one = read_shards(out), read_shards(single_run)
    assert sorted(resumed) == sorted(one) and all(resumed[k][0] == one[k][0] for k in one)
    # a third run has nothing left to do; other settings on the same folder are refused
    xl.main([images, out, "--vae", tiny_vae, *FLAGS])
    assert "0 of 4 shards to encode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        xl.main([images, out, "--vae", tiny_vae, "--resolution", str(RES), "--shard-size", "5", "--num-workers", "0"])
    assert "shard_size: 4 -> 5" in capsys.readouterr().err


def test_list_file_and_max_images(tiny_vae, images, tmp_path):
    lst = tmp_path / "list.txt"
    lst.write_text(f"# path label\n{images}/n02/img1.png 7\n{images}/n01/img0.png 2\n\n")
    out = str(tmp_path / "out")
    xl.main([str(lst), out, "--vae", tiny_vae, *FLAGS])
    samples = read_shards(out)
    assert [samples[k][0] for k in sorted(samples)] == [7, 2]
    assert json.load(open(os.path.join(out, "manifest.json")))["num_classes"] == 8
    out = str(tmp_path / "few")
    xl.main([images, out, "--vae", tiny_vae, *FLAGS, "--max-images", "5"])
    assert len(read_shards(out)) == 5


def test_random_sd_vae_is_the_architecture_of_the_throughput_figure(tmp_path):
    """tools.make_random_sdvae (the README's `--vae sdvae-arch-random`) is SD-VAE's architecture: 83,653,863
    parameters (the quoted 83.65M), 8x down-sampling, 4 latent channels (built on the meta device: no weights);
    its images are 256 x 256 RGB JPEGs in one class folder, as the extractor lists them."""
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(**SD_VAE_CONFIG)
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863
    assert vae_downsample_factor(vae) == 8 and vae.config.latent_channels == 4
    write_images(tmp_path, 3)
    items, classes, _ = xl.list_items(tmp_path)
    assert classes == ["0"] and [(os.path.basename(p), label) for p, label in items] == [
        (f"000{i}.jpg", 0) for i in range(3)]
    with Image.open(tmp_path / "0" / "0000.jpg") as im:
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (256, 256))


def test_center_crop_arr():
    img = Image.fromarray(np.random.RandomState(0).randint(0, 256, (300, 500, 3), dtype=np.uint8))
    for size in (32, 64, 256):
        arr = xl.center_crop_arr(img, size)
        assert arr.shape == (size, size, 3) and arr.dtype == np.uint8
    flat = Image.new("RGB", (130, 70), (10, 200, 30))
    assert (xl.center_crop_arr(flat, 32) == np.array([10, 200, 30], np.uint8)).all()


def cli(args, **env):
    proc = subprocess.run([sys.executable, "-m", "data.extract_latents", *args], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, **env), timeout=120)
    return proc.returncode, proc.stderr


def assert_one_line_error(capsys, fn):
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_input_one_line_errors(tiny_vae, images, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = assert_one_line_error(capsys, lambda: xl.main([str(empty), str(tmp_path / "o"), "--vae", tiny_vae]))
    assert "no images found" in err
    err = assert_one_line_error(capsys, lambda: xl.main([str(tmp_path / "missing"), str(tmp_path / "o")]))
    assert "does not exist" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = assert_one_line_error(capsys, lambda: xl.main([images, str(blocker / "out"), "--vae", tiny_vae]))
    assert "cannot be written" in err
    err = assert_one_line_error(capsys, lambda: xl.main([images, str(tmp_path / "o"), "--vae", tiny_vae, "--resolution", "33"]))
    assert "multiple" in err
    # a real process, offline, without the weights: one line on stderr, exit 2, no traceback
    code, err = cli([images, str(tmp_path / "o2"), "--resolution", "32"], HF_HUB_OFFLINE="1",
                    HF_HOME=str(tmp_path / "hf"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert "stabilityai/sd-vae-ft-ema" in err and "huggingface-cli download" in err


def test_vae_helpers(tiny_vae, tmp_path, monkeypatch):
    vae = load_sd_vae(tiny_vae, dtype=torch.float32)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    x = torch.rand(2, 3, RES, RES) * 2 - 1
    mean, logvar = encode_moments(vae, x)
    assert mean.shape == logvar.shape == (2, 4, LAT, LAT)
    img = decode_latents(vae, mean * SD_VAE_SCALE)
    assert img.shape == (2, RES, RES, 3) and img.dtype == torch.uint8
    expect = ((vae.decode(mean).sample + 1) * 127.5).clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (img.int() - expect.int()).abs().max() <= 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for bad in ("nobody-here/no-such-vae", str(tmp_path / "no_dir"), str(tmp_path)):
        with pytest.raises(UserError) as e:
            load_sd_vae(bad)
        assert "\n" not in str(e.value)
    assert "huggingface-cli download nobody-here/no-such-vae" in str(pytest.raises(UserError, load_sd_vae, "nobody-here/no-such-vae").value)


def test_convert_maskdit_arrays(tmp_path):
    src = tmp_path / "maskdit"
    src.mkdir()
    rng = np.random.RandomState(0)
    moments = rng.randn(5, 8, LAT, LAT).astype(np.float32)
    moments[:, 4:] = -30.0  # tiny std: samples equal the mean
    np.savez(src / "part0.npz", latents=moments[:3], labels=np.array([0, 1, 2]))
    np.save(src / "part1.npy", moments[3:])
    np.save(src / "part1.labels.npy", np.array([3, 4]))
    out = str(tmp_path / "out")
    xl.main(["convert-maskdit", str(src), out, "--shard-size", "2"])
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["num_samples"] == 5 and manifest["latent_shape"] == [8, LAT, LAT] and len(manifest["shards"]) == 3
    ds = LatentShardDataset(out, 4, LAT, 5)
    for i in range(5):
        x, y = ds[i]
        assert y == i
        torch.testing.assert_close(x, torch.from_numpy(moments[i, :4].astype(np.float16).astype(np.float32)) * SD_VAE_SCALE)


def test_convert_maskdit_lmdb(tmp_path):
    lmdb = pytest.importorskip("lmdb")
    src = tmp_path / "imagenet_256_latent_lmdb" / "train"
    src.mkdir(parents=True)
    rng = np.random.RandomState(0)
    n = 3
    z = rng.randn(2 * n, 8, LAT, LAT).astype(np.float32)  # MaskDiT: entries n..2n-1 are the x-flips
    with lmdb.open(str(src), map_size=1 << 26) as env, env.begin(write=True) as txn:
        for i in range(2 * n):
            txn.put(f"z-{i}".encode(), z[i].tobytes())
            txn.put(f"y-{i}".encode(), str(i % n + 10).encode())
        txn.put(b"length", str(2 * n).encode())
    out = str(tmp_path / "out")
    xl.main(["convert-maskdit", str(src.parent), out])
    samples = read_shards(out)
    assert len(samples) == n
    for i in range(n):
        y, arr = samples[f"{i:08d}"]
        assert y == i + 10 and arr.shape == (2, 8, LAT, LAT)
        np.testing.assert_allclose(arr[1].astype(np.float32), z[i + n], atol=2e-3, rtol=1e-3)


def test_images_are_stored_beside_latents_and_flipped_with_them(single_run, tiny_vae, images, tmp_path, capsys):
    """`--images` adds <key>.png, the exact centre crop; the reader's `with_images` returns it [3, R, R] uint8,
    mirrored exactly when the flipped latent of the pair is returned; shards without images are refused."""
    out = str(tmp_path / "img")
    xl.main([images, out, "--vae", tiny_vae, "--images", *FLAGS])
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert manifest["images"] == "png" and "images" not in json.loads(open(os.path.join(single_run, "manifest.json")).read())
    with tarfile.open(os.path.join(out, sw.shard_name(0))) as tf:
        png = tf.extractfile("00000000.png").read()
    with Image.open(os.path.join(images, "n01", "grey.png")) as im:
        crop = xl.center_crop_arr(im.convert("RGB"), RES)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), crop)
    assert read_shards(out).keys() == read_shards(single_run).keys()  # the same samples, and their latents
    plain = LatentShardDataset(out, in_channels=4, input_size=LAT, num_classes=3, random_flip=True, seed=5)
    withimg = LatentShardDataset(out, in_channels=4, input_size=LAT, num_classes=3, random_flip=True, seed=5,
                                 with_images=True)
    unflipped = LatentShardDataset(out, in_channels=4, input_size=LAT, num_classes=3, seed=5, with_images=True)
    flips = set()
    for i in range(len(withimg)):
        latent, label, image = withimg[i]
        base_latent, _, base_image = unflipped[i]
        assert torch.equal(latent, plain[i][0]) and label == plain[i][1] and image.shape == (3, RES, RES)
        flipped = not torch.equal(latent, base_latent)
        flips.add(flipped)
        assert torch.equal(image, base_image.flip(-1) if flipped else base_image)
    assert flips == {True, False}
    with pytest.raises(UserError, match=r"holds no images.*--images"):
        LatentShardDataset(single_run, in_channels=4, input_size=LAT, num_classes=3, with_images=True)
    with pytest.raises(SystemExit):  # a resume must not mix shards with and without images
        xl.main([images, out, "--vae", tiny_vae, *FLAGS])
    assert "other settings (images: 'png' -> None)" in capsys.readouterr().err
