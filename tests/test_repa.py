"""REPA (training/repa.py, training/repa_teachers.py): construction, the loss against a hand-written reference,
the kept-token masking under routing, where gradients go, bad config values, the FLOP count, optimizer states
with and without the projector, and one short train.py run that logs the term and resumes exactly."""
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from conftest import REPO, assert_one_line_error, run_script, tiny_overrides
from dit import DiT
from edm import EDMLoss, EDMPrecond
from training.checkpoint import list_checkpoints, load_checkpoint, load_sampling_net
from training.config_check import check_train_config, hydra_error_line
from training.repa import (RepaLoss, alignment_loss, build_repa, fit_optimizer_state, load_projector,
                           projector_training_flops, to_token_grid)
from training.repa_teachers import build_teacher, dinov2_weights_file
from tread_utils.errors import UserError

REPA_ON = OmegaConf.create({"enabled": True, "block": 1, "weight": 0.5, "encoder": "digits_classifier",
                            "encoder_weights": None, "projector_dim": 16})


def tiny_dit(ratio=0.5):
    torch.manual_seed(0)
    return DiT(input_size=16, patch_size=2, in_channels=1, hidden_size=32, depth=4, num_heads=2, num_classes=10,
               enable_routing=True, routes=[dict(start_layer_idx=1, end_layer_idx=2, selection_ratio=ratio)])


class FixedTeacher(nn.Module):
    """Features [B, h*w, dim] set by the test, by default on the 8 x 8 token grid of `tiny_dit`."""
    dim = 8

    def __init__(self, features, grid=(8, 8)):
        super().__init__()
        self.features, self.grid = features, grid

    def forward(self, images):
        self.seen = images
        return self.features, self.grid


def repa_pieces(teacher_features, block=1, weight=0.5):
    model = tiny_dit()
    net, loss_fn, projector = build_repa(OmegaConf.merge(REPA_ON, {"block": block, "weight": weight}), model,
                                         EDMPrecond(model), EDMLoss())
    loss_fn.teacher = FixedTeacher(teacher_features)
    net.projector = projector = nn.Sequential(nn.Linear(32, FixedTeacher.dim))  # sized for the fixed teacher
    return model, net.train(), loss_fn, projector


def batch(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 16, 16, generator=g) * 2 - 1, torch.arange(n) % 10


def test_construction_and_off_by_default():
    model = tiny_dit()
    denoiser, base = EDMPrecond(model), EDMLoss()
    assert build_repa(OmegaConf.merge(REPA_ON, {"enabled": False}), model, denoiser, base) == (denoiser, base, None)
    net, loss_fn, projector = build_repa(REPA_ON, model, denoiser, base)
    shapes = [tuple(m.weight.shape) for m in projector if isinstance(m, nn.Linear)]
    assert shapes == [(16, 32), (16, 16), (64, 16)]  # hidden -> projector_dim -> projector_dim -> teacher's 64
    assert net.net is denoiser and loss_fn.base is base and loss_fn.token_grid == (8, 8)
    assert not any(p.requires_grad for p in loss_fn.teacher.parameters()) and not loss_fn.teacher.training
    assert "projector" not in " ".join(model.state_dict())  # the backbone (and so the EMA) is unchanged


def test_teachers_give_patch_features_on_their_grid():
    digits = build_teacher("digits_classifier")  # the shipped weights: runs on any machine
    features, grid = digits(batch()[0])
    assert features.shape == (4, 64, 64) and grid == (8, 8) and features.min() >= 0  # after ReLU
    with torch.device("meta"):  # DINOv2 ViT-B/14 with random weights: shapes only, no download, no compute
        dino = build_teacher("dinov2_vitb14", load=False)
        for size, channels, g in ((256, 3, 16), (512, 3, 32), (16, 1, 16)):
            features, grid = dino(torch.zeros(2, channels, size, size))
            assert features.shape == (2, g * g, 768) and grid == (g, g)


def test_teacher_grid_is_resized_to_the_token_grid():
    index = torch.arange(16.0)
    rows_cols = torch.stack([index.view(16, 1).expand(16, 16), index.view(1, 16).expand(16, 16)], -1)
    features = rows_cols.reshape(1, 256, 2)  # channel 0: the row of a 16 x 16 patch, channel 1: its column
    small = to_token_grid(features, (16, 16), (8, 8)).view(8, 8, 2)
    rows, cols = small[..., 0], small[..., 1]
    assert torch.allclose(rows, rows[:, :1].expand(8, 8)) and torch.all(rows[1:, 0] > rows[:-1, 0])
    assert torch.allclose(cols, cols[:1].expand(8, 8)) and torch.all(cols[0, 1:] > cols[0, :-1])
    assert to_token_grid(features, (16, 16), (16, 16)) is features


def reference_alignment(projected, target, keep):
    """-cos per token, written out, averaged over the projected tokens of each sample."""
    out = []
    for b in range(projected.shape[0]):
        total = 0.0
        for k in range(projected.shape[1]):
            p, t = projected[b, k].tolist(), target[b, keep[b][k]].tolist()
            dot = sum(x * y for x, y in zip(p, t))
            total += -dot / (math.sqrt(sum(x * x for x in p)) * math.sqrt(sum(y * y for y in t)))
        out.append(total / projected.shape[1])
    return torch.tensor(out)


def test_loss_against_a_hand_written_reference():
    g = torch.Generator().manual_seed(0)
    projected, target = torch.randn(2, 3, 5, generator=g), torch.randn(2, 6, 5, generator=g) * 3
    keep = torch.tensor([[0, 2, 5], [1, 3, 4]])
    assert torch.allclose(alignment_loss(projected, target, keep), reference_alignment(projected, target, keep),
                          atol=1e-6)
    full = torch.randn(2, 3, 5, generator=g)
    assert torch.allclose(alignment_loss(full, target[:, :3]), reference_alignment(full, target, [[0, 1, 2]] * 2),
                          atol=1e-6)

    class Net:  # the diffusion loss of every element is 2; the projector's output is `projected`
        def __call__(self, x, sigma, labels, repa_tap):
            repa_tap.projected, repa_tap.keep_idx = projected, keep
            return x

    repa = RepaLoss(lambda net, x, y, **kw: torch.full_like(net(x, None, y, **kw), 2.0),
                    FixedTeacher(target, (2, 3)), weight=0.5, block=0, token_grid=(2, 3))
    total = repa(Net(), torch.zeros(2, 1, 4, 4)).mean()
    assert torch.allclose(total, 2.0 + 0.5 * reference_alignment(projected, target, keep).mean(), atol=1e-6)
    assert torch.allclose(repa.last, reference_alignment(projected, target, keep).mean(), atol=1e-6)


def test_only_kept_tokens_count_inside_a_route():
    x, y = batch()
    features = torch.randn(4, 64, FixedTeacher.dim, generator=torch.Generator().manual_seed(2))
    model, net, loss_fn, _ = repa_pieces(features, block=1)  # block 1 lies inside the route 1 -> 2

    class Spy(nn.Module):  # keeps the tap of the last call
        def forward(self, *args, repa_tap, **kwargs):
            self.tap = repa_tap
            return net(*args, repa_tap=repa_tap, **kwargs)

    spy = Spy()

    def loss_and_kept(teacher_features):
        loss_fn.teacher.features = teacher_features
        torch.manual_seed(3)  # the same noise and the same kept tokens every call
        return loss_fn(spy, x, y).mean(), spy.tap

    loss, tap = loss_and_kept(features)
    assert torch.equal(loss_fn.teacher.seen, x)  # the clean image, not the noised one
    assert tap.hidden.shape[1] == 32 and tap.keep_idx.shape == (4, 32)  # half of the 64 tokens go through
    dropped = sorted(set(range(64)) - set(tap.keep_idx[0].tolist()))[0]
    kept = int(tap.keep_idx[0, 0])
    changed = features.clone()
    changed[0, dropped] = -changed[0, dropped] + 5
    assert torch.equal(loss_and_kept(changed)[0], loss)
    changed = features.clone()
    changed[0, kept] = -changed[0, kept] + 5
    assert not torch.allclose(loss_and_kept(changed)[0], loss)


def test_gradients_reach_the_projector_and_the_blocks_up_to_the_aligned_one():
    x, y = batch()
    features = torch.randn(4, 64, FixedTeacher.dim, generator=torch.Generator().manual_seed(2))
    model, net, loss_fn, projector = repa_pieces(features, block=1, weight=1.0)
    loss_fn.base = lambda n, i, l, **kw: 0.0 * n(i, torch.ones(len(i)), l, **kw)  # the alignment term alone
    loss_fn(net, x, y).mean().backward()

    def moved(module):
        return any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())

    assert moved(projector) and moved(model.x_embedder) and moved(model.blocks[0]) and moved(model.blocks[1])
    assert not moved(model.blocks[2]) and not moved(model.blocks[3]) and not moved(model.final_layer)


def test_projector_flops_match_the_flop_counter():
    projector = build_repa(REPA_ON, tiny_dit(), EDMPrecond(tiny_dit()), EDMLoss())[2]
    h = torch.randn(3, 32, 32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        projector(h).sum().backward()
    assert counter.get_total_flops() == 3 * projector_training_flops(32, 16, 64, 32)


def test_optimizer_state_with_and_without_the_projector():
    model = tiny_dit()
    projector = build_repa(REPA_ON, model, EDMPrecond(model), EDMLoss())[2]
    n = len(list(model.parameters()))
    plain = torch.optim.AdamW(model.parameters())
    model(*batch()[:1], torch.ones(4)).sum().backward()
    plain.step()
    with_repa = torch.optim.AdamW(list(model.parameters()) + list(projector.parameters()))
    with_repa.load_state_dict(fit_optimizer_state(plain.state_dict(), with_repa, n, saved_has_repa=False))
    assert len(with_repa.state) == n  # the model's moments kept, the projector's start fresh
    back = torch.optim.AdamW(model.parameters())
    back.load_state_dict(fit_optimizer_state(with_repa.state_dict(), back, n, saved_has_repa=True))
    assert all(torch.equal(back.state[p]["exp_avg"], plain.state[p]["exp_avg"]) for p in model.parameters())


def test_projector_from_checkpoints_with_and_without_it(capsys):
    model = tiny_dit()
    projector = build_repa(REPA_ON, model, EDMPrecond(model), EDMLoss())[2]
    before = {k: v.clone() for k, v in projector.state_dict().items()}
    load_projector(projector, {"model": {}}, "old.pt")  # written before REPA: the projector starts fresh
    assert all(torch.equal(before[k], v) for k, v in projector.state_dict().items())
    assert "holds no REPA projector" in capsys.readouterr().out
    saved = {k: torch.zeros_like(v) for k, v in before.items()}
    load_projector(projector, {"repa": saved}, "new.pt")
    assert all(v.abs().sum() == 0 for v in projector.state_dict().values())
    wider = build_repa(OmegaConf.merge(REPA_ON, {"projector_dim": 8}), model, EDMPrecond(model), EDMLoss())[2]
    with pytest.raises(UserError, match="repa.projector_dim") as e:
        load_projector(wider, {"repa": saved}, "new.pt")
    assert "\n" not in str(e.value)


def compose_train(*overrides):
    try:  # a wrong type is refused while composing (the schema is the base), in train.py's words
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    except HydraException as e:
        raise UserError(hydra_error_line(e)) from None


@pytest.mark.parametrize("overrides, needle", [
    (["repa.weight=-1"], "repa.weight=-1"),
    (["repa.projector_dim=0"], "repa.projector_dim=0"),
    (["repa.encoder=clip"], "repa.encoder=clip"),
    (["repa.block=-2"], "repa.block=-2"),
    (["repa.enabled=true", "repa.block=12"], "repa.block=12"),
    (["repa.enabled=true", "repa.encoder_weights=/no/such/file"], "repa.encoder_weights"),
    (["repa.enabled=maybe"], "repa.enabled"),
])
def test_bad_values_are_refused_in_one_line(overrides, needle):
    with pytest.raises(UserError) as e:
        check_train_config(compose_train(*overrides), world_size=1)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_dinov2_offline_without_weights_names_what_to_download(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError) as e:
        check_train_config(compose_train("repa.enabled=true", "repa.encoder=dinov2_vitb14"), world_size=1)
    assert "timm/vit_base_patch14_dinov2.lvd142m" in str(e.value) and "repa.encoder_weights" in str(e.value)
    assert "\n" not in str(e.value)
    assert check_train_config(compose_train(), world_size=1).config.repa.enabled is False  # the default: off


def test_dinov2_weights_are_found_in_a_folder_a_file_or_the_hub_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    folder = tmp_path / "dino"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    weights = folder / "model.safetensors"
    assert dinov2_weights_file(folder) == weights == dinov2_weights_file(weights)
    with pytest.raises(UserError, match="holds no DINOv2 weights"):
        dinov2_weights_file(tmp_path)
    snapshot = tmp_path / "hub" / "models--timm--vit_base_patch14_dinov2.lvd142m"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("abc")
    (snapshot / "snapshots" / "abc").mkdir(parents=True)
    (snapshot / "snapshots" / "abc" / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert dinov2_weights_file(None) == snapshot / "snapshots" / "abc" / "model.safetensors"


def test_train_logs_the_repa_term_and_resumes_exactly(tmp_path):
    args = [f"results_dir={tmp_path}", *tiny_overrides("tread"), "repa.enabled=true", "repa.block=1",
            "repa.projector_dim=32", "train.max_steps=6", "train.ckpt_every=3", "train.logging.log_interval=3"]
    run_script("train.py", "run_name=a", *args, check=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "checkpoints" / "ckpt_00000006.pt").unlink()
    resumed = run_script("train.py", "run_name=b", *args, check=True)
    assert "resuming from" in resumed.stdout and "REPA: projector" in resumed.stdout
    a, b = (load_checkpoint(list_checkpoints(tmp_path / r / "checkpoints")[-1][1]) for r in "ab")
    assert a["step"] == b["step"] == 6
    for key in ("model", "ema", "repa"):
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"
    assert set(a["repa"]) == {f"{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")}
    assert len(a["optimizer"]["param_groups"][0]["params"]) == len(a["model"]) + len(a["repa"])  # trained too
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    logs = [[json.loads(line) for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab"]
    assert [r["step"] for r in logs[0]] == [3, 6] and all(-1 <= r["repa_loss"] <= 1 for r in logs[0])
    assert logs[0][-1]["repa_loss"] == logs[1][-1]["repa_loss"] and logs[0][-1]["loss"] == logs[1][-1]["loss"]
    load_sampling_net(tmp_path / "a")  # the sampling weights (EMA backbone) load as without REPA


def test_bad_value_through_train_py(tmp_path):
    assert_one_line_error(run_script("train.py", f"results_dir={tmp_path}", "repa.weight=-0.5"), "repa.weight")


def test_on_latent_shards_the_teacher_sees_the_stored_images_flipped_with_their_latents(tmp_path):
    """Shards written with images -> LatentShardDataset(with_images) -> the DataLoader -> one training step
    (training.loop.accumulate_gradients): the teacher gets each sample's stored crop in [-1, 1], mirrored
    where its latent is the flipped one, while the network gets the latents."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from data import build_dataset
    from data.shard_writer import ShardWriter
    from training.loop import accumulate_gradients

    rng = np.random.default_rng(0)
    crops = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    pairs = rng.standard_normal((6, 2, 4, 2, 2)).astype(np.float16)  # [original, flipped] latents
    (tmp_path / ".progress").mkdir()  # the shard's done-marker goes there
    writer = ShardWriter(str(tmp_path), 0)
    for i in range(6):
        writer.add(f"{i:08d}", pairs[i], i % 3, crops[i])
    writer.finish()
    cfg = OmegaConf.create({"kind": "shards", "train_path": str(tmp_path), "in_channels": 4, "input_size": 2,
                            "num_classes": 3, "scale_factor": 1.0, "random_flip": True})
    data = torch.utils.data.DataLoader(build_dataset(cfg, seed=3, teacher_images=True), batch_size=6)
    teacher, seen = FixedTeacher(torch.ones(6, 1, 8), grid=(1, 1)), {}

    def base(net, x, y, repa_tap):
        seen["x"] = x
        repa_tap.projected = torch.ones(6, 1, 8, requires_grad=True)
        return x.sum((1, 2, 3))

    run = SimpleNamespace(accelerator=Accelerator(cpu=True), data_iter=iter(data), net=None, accum=1,
                          loss_fn=RepaLoss(base, teacher, 0.5, 0, (1, 1)), projector=None)
    accumulate_gradients(run, num_classes=3, drop_prob=0.0)
    flipped = [bool((seen["x"][i].numpy() == pairs[i, 1]).all()) for i in range(6)]
    assert {True, False} == set(flipped)  # both cases occur at this seed
    for i, flip in enumerate(flipped):
        image = torch.from_numpy(crops[i][:, ::-1].copy() if flip else crops[i]).permute(2, 0, 1).float()
        assert torch.equal(teacher.seen[i], image / 127.5 - 1)
    assert build_dataset(cfg, seed=3)[0][0].shape == (4, 2, 2) and len(build_dataset(cfg, seed=3)[0]) == 2
