"""LatentShardDataset: every stored layout, deterministic addressing, npy pairs, index caching, bad input."""
import json
import os

import numpy as np
import pytest
import torch

from data.shards import SIDECAR_EXT, LatentShardDataset
from tread_utils.errors import UserError

C, S, K = 4, 8, 10  # channels, latent side, classes
SCALE = 0.18215


def write_tar(path, samples):
    """samples: [(key, array, label)] written with webdataset's own TarWriter (the official TREAD layout)."""
    import webdataset as wds

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for key, arr, label in samples:
            sink.write({"__key__": key, "latent.npy": arr, "cls": label})
    return str(path)


def simple(n, shape, start=0, dtype=np.float16, seed=0):
    rng = np.random.RandomState(seed)
    return [(f"{start + i:06d}", rng.randn(*shape).astype(dtype), (start + i) % K) for i in range(n)]


def one_line(err):
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def test_single_latents_are_scaled_float32(tmp_path):
    samples = simple(5, (C, S, S))
    write_tar(tmp_path / "a.tar", samples)
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert len(ds) == 5
    for i, (_, arr, label) in enumerate(samples):
        x, y = ds[i]
        assert x.dtype == torch.float32 and x.shape == (C, S, S) and y == label and isinstance(y, int)
        torch.testing.assert_close(x, torch.from_numpy(arr.astype(np.float32)) * SCALE)
    x, _ = LatentShardDataset(tmp_path, C, S, K, scale_factor=1.0)[0]  # pre-scaled data: scale_factor=1
    torch.testing.assert_close(x, torch.from_numpy(samples[0][1].astype(np.float32)))


def test_moments_are_sampled_then_scaled(tmp_path):
    mean = np.random.RandomState(1).randn(C, S, S).astype(np.float32)
    std = 2.0
    moments = np.concatenate([mean, np.full((C, S, S), 2 * np.log(std), np.float32)])  # [2C, S, S]
    write_tar(tmp_path / "m.tar", [(f"{i:04d}", moments, 3) for i in range(64)])
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE, posterior_sampling=True)
    eps = torch.stack([(ds[i][0] / SCALE - torch.from_numpy(mean)) / std for i in range(64)])
    assert eps.shape == (64, C, S, S)
    assert abs(eps.mean().item()) < 0.05 and abs(eps.std().item() - 1.0) < 0.05  # mean + std * N(0, 1)
    assert not torch.equal(eps[0], eps[1])
    # the authors' data path (the default): one fixed latent per image, the posterior mean
    mean_only = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert all(torch.equal(mean_only[i][0], torch.from_numpy(mean) * np.float32(SCALE)) for i in (0, 63, 64))


def test_addressing_is_deterministic_per_index_and_epoch(tmp_path):
    moments = np.random.RandomState(2).randn(8, 2 * C, S, S).astype(np.float16)
    write_tar(tmp_path / "m.tar", [(f"{i:04d}", moments[i], 1) for i in range(8)])
    kw = dict(posterior_sampling=True, scale_factor=SCALE)
    ds = LatentShardDataset(tmp_path, C, S, K, seed=5, **kw)
    n = len(ds)
    assert torch.equal(ds[3][0], ds[3][0])
    assert torch.equal(ds[3][0], LatentShardDataset(tmp_path, C, S, K, seed=5, **kw)[3][0])  # a fresh reader, same draw
    assert not torch.equal(ds[3][0], ds[3 + n][0])  # next epoch: same sample, fresh noise
    assert not torch.equal(ds[3][0], LatentShardDataset(tmp_path, C, S, K, seed=6, **kw)[3][0])
    assert ds[3 + 7 * n][1] == ds[3][1]  # any non-negative index works
    with pytest.raises(IndexError):
        ds[-1]
    # DataLoader workers see exactly what the main process sees
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, sampler=range(2 * n))
    got = torch.cat([x for x, _ in loader])
    torch.testing.assert_close(got, torch.stack([ds[i][0] for i in range(2 * n)]), rtol=0, atol=0)


@pytest.mark.parametrize("channels", [C, 2 * C])
def test_flip_pairs_pick_either_half_with_random_flip(tmp_path, channels):
    pair = np.stack([np.full((channels, S, S), 1.0), np.full((channels, S, S), -1.0)]).astype(np.float16)
    if channels == 2 * C:  # moments with a tiny std: the sample sits on the mean
        pair[:, C:] = -30.0
    write_tar(tmp_path / "p.tar", [(f"{i:04d}", pair, 0) for i in range(32)])
    for random_flip, expected in ((True, {1, -1}), (False, {1})):  # off (the authors'): always the image
        ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE, random_flip=random_flip)
        signs = set()
        for i in range(32):
            x, _ = ds[i]
            assert x.shape == (C, S, S)
            signs.add(round(float(x.mean() / SCALE)))
        assert signs == expected


def test_random_flip_only_when_asked(tmp_path):
    ramp = np.broadcast_to(np.arange(S, dtype=np.float32), (C, S, S)).copy()
    write_tar(tmp_path / "r.tar", [(f"{i:04d}", ramp, 0) for i in range(32)])
    plain = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert all(plain[i][0][0, 0, 0] == 0 for i in range(32))
    flipping = LatentShardDataset(tmp_path, C, S, K, random_flip=True, scale_factor=SCALE)
    firsts = {float(flipping[i][0][0, 0, 0] / SCALE) for i in range(32)}
    assert firsts == {0.0, float(S - 1)}


def test_npy_pairs_are_memory_mapped(tmp_path):
    lat = np.random.RandomState(3).randn(6, 2, 2 * C, S, S).astype(np.float16)
    sub = tmp_path / "sub"
    sub.mkdir()
    np.save(sub / "part0.latents.npy", lat)
    np.save(sub / "part0.labels.npy", np.arange(6) % K)
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert len(ds) == 6 and ds[4][1] == 4 and ds[4][0].shape == (C, S, S)
    assert isinstance(ds.shards[0]._open()[0], np.memmap)
    # pickling for spawned workers carries no data
    import pickle

    assert len(pickle.dumps(ds)) < 10_000


def test_mixed_formats_and_single_file(tmp_path):
    write_tar(tmp_path / "x" / "a.tar", simple(3, (C, S, S)))
    write_tar(tmp_path / "y" / "b.tar", simple(4, (2, C, S, S), start=3))
    np.save(tmp_path / "c.latents.npy", np.zeros((2, C, S, S), np.float32))
    np.save(tmp_path / "c.labels.npy", np.array([1, 2]))
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert len(ds) == 9
    assert [ds[i][1] for i in range(9)] == [1, 2, 0, 1, 2, 3, 4, 5, 6]  # sorted by path: c, x/a, y/b
    assert len(LatentShardDataset(tmp_path / "x" / "a.tar", C, S, K)) == 3


def test_tar_index_sidecar_and_manifest(tmp_path):
    path = write_tar(tmp_path / "a.tar", simple(5, (C, S, S)))
    first = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)[2][0]
    assert os.path.isfile(path + SIDECAR_EXT)
    assert torch.equal(LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)[2][0], first)  # from the sidecar
    write_tar(tmp_path / "a.tar", simple(7, (C, S, S), seed=9))  # rewritten: the stale sidecar is ignored
    os.utime(path, ns=(1, 1))
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert len(ds) == 7 and not torch.equal(ds[2][0], first)
    # a consistent manifest gives the counts without indexing at init
    manifest = {"shards": [{"name": "a.tar", "count": 7, "bytes": os.path.getsize(path)}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    os.remove(path + SIDECAR_EXT)
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)  # a given scale: nothing is read at init
    assert ds.shards[0]._rows is None and len(ds) == 7 and ds[6][1] == 6 % K
    manifest["shards"][0]["bytes"] += 1  # inconsistent: ignored, the tar is indexed
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE).shards[0]._rows is not None


def test_missing_path_and_no_shards(tmp_path):
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path / "nope", C, S, K)
    assert "does not exist" in one_line(e)
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "*.tar" in one_line(e) and "*.latents.npy" in one_line(e)


def test_shape_mismatch_at_init_and_at_read(tmp_path):
    write_tar(tmp_path / "a.tar", simple(2, (C, S, S)))
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, 2 * S, K)
    msg = one_line(e)
    assert "a.tar" in msg and str([C, S, S]) in msg and "input_size=16" in msg
    write_tar(tmp_path / "b.tar", simple(1, (C, S, S)) + [("000009", np.zeros((3, S, S), np.float16), 0)])
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)  # first sample of every shard fits
    with pytest.raises(UserError) as e:
        ds[3]
    assert "b.tar" in one_line(e) and "000009" in one_line(e) and "[3, 8, 8]" in one_line(e)
    np.save(tmp_path / "n.latents.npy", np.zeros((2, 5, S, S), np.float16))
    np.save(tmp_path / "n.labels.npy", np.zeros(2, np.int64))
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "n.latents.npy" in one_line(e)


def test_corrupt_files(tmp_path):
    (tmp_path / "bad.tar").write_bytes(os.urandom(3000))
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "bad.tar" in one_line(e)
    os.remove(tmp_path / "bad.tar")
    path = write_tar(tmp_path / "cut.tar", simple(4, (C, S, S)))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "cut.tar" in one_line(e)
    os.remove(path)
    np.save(tmp_path / "q.latents.npy", np.zeros((2, C, S, S), np.float16))
    with pytest.raises(UserError) as e:  # labels file missing
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "q.labels.npy" in one_line(e)
    (tmp_path / "q.labels.npy").write_bytes(b"garbage")
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert "q.labels.npy" in one_line(e)


def test_corrupt_sample_bytes_named(tmp_path):
    path = write_tar(tmp_path / "a.tar", simple(2, (C, S, S)))
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    off = int(ds.shards[0]._rows[1, 0])
    with open(path, "r+b") as f:  # clobber the .npy magic of the second sample
        f.seek(off)
        f.write(b"XXXXXXXX")
    with pytest.raises(UserError) as e:
        ds[1]
    assert "a.tar" in one_line(e) and "000001" in one_line(e)


def test_label_out_of_range_names_file_and_key(tmp_path):
    write_tar(tmp_path / "a.tar", [("k0", np.zeros((C, S, S), np.float16), 1), ("k1", np.zeros((C, S, S), np.float16), 12)])
    ds = LatentShardDataset(tmp_path, C, S, K, scale_factor=SCALE)
    assert ds[0][1] == 1
    with pytest.raises(UserError) as e:
        ds[1]
    msg = one_line(e)
    assert "a.tar" in msg and "k1" in msg and "12" in msg


@pytest.mark.parametrize("std, expected, why", [(1 / SCALE, SCALE, "like unscaled SD-VAE output"),
                                                (1.0, 1.0, "already multiplied by 0.18215")])
def test_without_a_manifest_the_scale_is_measured_and_said(tmp_path, std, expected, why):
    """The authors' shards hold latents already scaled by 0.18215: they must not be scaled twice, silently."""
    samples = [(f"{i:04d}", (std * np.random.RandomState(i).randn(C, S, S)).astype(np.float16), 1) for i in range(40)]
    write_tar(tmp_path / "a.tar", samples)
    ds = LatentShardDataset(tmp_path, C, S, K)
    assert ds.scale_factor == pytest.approx(expected) and why in ds.scale_note and "\n" not in ds.scale_note
    torch.testing.assert_close(ds[0][0], torch.from_numpy(samples[0][1].astype(np.float32)) * np.float32(expected))
    given = LatentShardDataset(tmp_path, C, S, K, scale_factor=0.5)  # dataset.scale_factor overrides
    assert given.scale_factor == 0.5 and "dataset.scale_factor" in given.scale_note


@pytest.mark.parametrize("scaled, expected", [(False, SCALE), (True, 1.0)])
def test_the_manifest_decides_the_scale(tmp_path, scaled, expected):
    path = write_tar(tmp_path / "a.tar", simple(3, (C, S, S)))
    manifest = {"scale_factor": SCALE, "scaled": scaled,
                "shards": [{"name": "a.tar", "count": 3, "bytes": os.path.getsize(path)}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    ds = LatentShardDataset(tmp_path, C, S, K)
    assert ds.scale_factor == pytest.approx(expected) and "manifest.json" in ds.scale_note
    assert ds.shards[0]._rows is None  # decided without reading a sample


@pytest.mark.parametrize("text, said", [('{"scale_factor": 0.18215,}', "JSONDecodeError"), ("[1, 2]", "holds a list")])
def test_a_malformed_manifest_is_refused_not_taken_for_absent(tmp_path, text, said):
    """Read as absent, a manifest with a trailing comma would give the default scale and VAE unseen."""
    write_tar(tmp_path / "a.tar", simple(3, (C, S, S)))
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(UserError) as e:
        LatentShardDataset(tmp_path, C, S, K)
    msg = one_line(e)
    assert str(tmp_path / "manifest.json") in msg and said in msg


def test_a_shard_is_opened_once_per_process_not_per_sample(tmp_path, monkeypatch):
    """The trainer and every DataLoader worker open a shard once and keep it; a worker forked after the
    parent opened it opens its own; deleting the dataset closes the descriptor."""
    import collections
    import gc

    from data import shards

    write_tar(tmp_path / "d" / "a.tar", simple(40, (C, S, S)))
    log, real_open = tmp_path / "opens.txt", shards.open_shard

    def counting_open(path):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_open(path)

    monkeypatch.setattr(shards, "open_shard", counting_open)
    ds = LatentShardDataset(tmp_path / "d", C, S, K)
    for i in range(3 * len(ds)):  # three epochs in this process
        ds[i]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert sum(len(y) for _, y in loader) == len(ds)
    opens = collections.Counter(log.read_text().split())
    assert opens.pop(str(os.getpid())) == 1
    assert len(opens) == 2 and set(opens.values()) == {1}, opens  # one per worker

    fd = ds.shards[0]._file[1]
    os.fstat(fd)
    del ds, loader
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
