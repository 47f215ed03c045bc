"""What a GPU run of lab/bench.py needs and a CPU can show: the matmul ceiling's memory, out-of-memory
variants, micro-batches, activation checkpointing, the float32 block after a route, and the FID section's
stages, partial record, VAE batches and fixed compiled batch shape."""
import json
import sys
import weakref

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import assert_one_line_error, run_script, save_tiny_vae
from dit import get_model
from edm import EDMPrecond
from generation.generate import generate, make_sampler
from lab import bench, bench_evaluation, bench_timing, bench_training

TINY = ["--backbones", "DiT-T/8", "--steps", "1", "--warmup", "1", "--sections", "training"]


def run_bench(monkeypatch, tmp_path, *args):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", *args, "--out", str(out)])
    bench.main()
    return json.loads(out.read_text())


class LiveTensors(TorchFunctionMode):
    """Counts torch calls and the most tensors made by them that were alive at once."""

    def __init__(self):
        super().__init__()
        self.refs, self.most, self.calls = [], 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))
        self.most = max(self.most, len({id(t) for t in (r() for r in self.refs) if t is not None}))
        return out

    def alive(self):
        return sum(r() is not None for r in self.refs)


def test_matmul_ceiling_holds_three_matrices_whatever_the_repeat_count(monkeypatch):
    """The repeat count doubles until the timed work lasts min_seconds (up to 512 products of 8192^2 on an H100):
    every product goes into one output, and nothing it made is alive once it returns. A fake clock charges 1 ms
    per torch call, so the count reaches 64 here whatever this machine's speed."""
    live = LiveTensors()

    def fake_timed(device, fn):
        before = live.calls
        fn()
        return 1e-3 * (live.calls - before)

    monkeypatch.setattr(bench_timing, "timed", fake_timed)
    with live:
        ceiling = bench_timing.matmul_ceiling(torch.device("cpu"), None, size=32, min_seconds=0.05, trials=2)
    assert ceiling == 2 * 32 ** 3 * 64 / 0.064
    assert live.calls > 2 * 64 and live.most <= 3  # a, b and the one output
    assert live.alive() == 0


def test_an_out_of_memory_variant_is_recorded_and_the_bench_goes_on(monkeypatch, tmp_path):
    """The dense variant runs out of memory on its first step: its row says so with the batch and micro-batch
    tried, its model is freed before the next variant is built, and the routed variants are timed."""
    real_step, models = bench_training.training_step, []

    def step_running_out_of_memory(model, batch, device, dtype, context, micro_batch):
        if models:  # the previous variant's model is gone by the time the next one is built
            assert models[-1]() is None
        models.append(weakref.ref(model))
        step = real_step(model, batch, device, dtype, context, micro_batch)
        if model.router.enable_routing:
            return step

        def oom():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return oom

    monkeypatch.setattr(bench_training, "training_step", step_running_out_of_memory)
    result = run_bench(monkeypatch, tmp_path, *TINY, "--batch-sizes", "4", "--micro-batch", "2",
                       "--fp32-after-route", "both")
    dense, routed, routed_bf16 = result["training"]
    assert dense["oom"] is True and dense["batch"] == 4 and dense["micro_batch"] == 2 and dense["model"] == "dit"
    assert "out of memory" in dense["error"] and "step_s" not in dense
    assert [routed["model"], routed["fp32_after_route"], routed_bf16["fp32_after_route"]] == ["tread", True, False]
    assert routed["step_s"] > 0 and routed_bf16["step_s"] > 0 and "speedup" not in routed  # no dense time to divide
    assert len(models) == 3 and "out of memory" in (tmp_path / "bench.md").read_text()


def test_a_failure_that_is_not_out_of_memory_is_not_swallowed():
    def build():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        bench_timing.time_or_out_of_memory(build, 1, 0, torch.device("cpu"))
    wrapped = RuntimeError("compiling failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert bench_timing.out_of_memory(wrapped) and not bench_timing.out_of_memory(RuntimeError("x"))


def test_micro_batches_make_one_optimizer_step_and_mfu_counts_the_whole_batch(monkeypatch, tmp_path):
    """--micro-batch 2 at batch 4: two forward passes of 2 samples, one AdamW step, FLOPs of all 4 samples;
    --fp32-after-route off builds the routed model without its float32 block; --compile-backend eager
    traces with dynamo (graphs counted) without inductor."""
    seen = {"forward": [], "adamw_steps": 0, "fp32": []}
    real_step, real_adamw_step = bench_training.training_step, torch.optim.AdamW.step

    def recording(model, batch, device, dtype, context, micro_batch):
        module = getattr(model, "_orig_mod", model)
        seen["fp32"].append((module.router.enable_routing, module.router.fp32_after_route))
        module.register_forward_pre_hook(lambda m, inputs: seen["forward"].append(len(inputs[0])))
        return real_step(model, batch, device, dtype, context, micro_batch)

    def counting_step(self, *a, **kw):
        seen["adamw_steps"] += 1
        return real_adamw_step(self, *a, **kw)

    monkeypatch.setattr(bench_training, "training_step", recording)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    result = run_bench(monkeypatch, tmp_path, *TINY, "--batch-sizes", "4", "--micro-batch", "2", "--compile",
                       "--compile-backend", "eager", "--fp32-after-route", "off")
    rows = result["training"]
    assert seen["forward"] == [2, 2] * 4 and seen["adamw_steps"] == 4  # 2 variants x (1 warm-up + 1 timed)
    assert seen["fp32"] == [(False, True), (True, False)]
    assert [r["fp32_after_route"] for r in rows] == [None, False] and all(r["graphs"] > 0 for r in rows)
    dense_params = bench_training.model_params("DiT-T/8", False)
    assert rows[0]["flops_per_step"] == bench_training.training_step_flops("DiT-T/8", dense_params, 4, routing=False)
    assert result["compile_backend"] == "eager" and rows[0]["micro_batch"] == 2


def test_default_micro_batch_fits_xl2_at_batch_256_and_a_bad_one_is_one_line():
    args = bench.parse_args(["--backbones", "DiT-XL/2", "DiT-B/2"])
    micro_batch_for = bench_training.micro_batch_for
    assert micro_batch_for(args, "DiT-XL/2", 256) == 128 and micro_batch_for(args, "DiT-XL/2", 200) == 100
    assert micro_batch_for(args, "DiT-B/2", 256) == 256
    assert micro_batch_for(bench.parse_args(["--batch-sizes", "256", "--micro-batch", "64"]), "DiT-XL/2", 256) == 64
    assert_one_line_error(run_script("lab.bench", "--batch-sizes", "8", "12", "--micro-batch", "8"),
                          "--micro-batch 8 does not divide batch size(s) [12]")


def test_grad_checkpointing_counts_the_recomputed_forward_apart(monkeypatch, tmp_path):
    import dit

    calls = []
    real = dit.checkpoint
    monkeypatch.setattr(dit, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    result = run_bench(monkeypatch, tmp_path, *TINY, "--batch-sizes", "2", "--grad-checkpointing")
    dense, routed = result["training"]
    assert calls and result["grad_checkpointing"] is True
    for row in (dense, routed):
        assert row["recomputed_flops_per_step"] > 0 and row["hfu"] > row["mfu"]
        assert row["hfu"] / row["mfu"] == pytest.approx(1 + row["recomputed_flops_per_step"] / row["flops_per_step"])
    dense_params = bench_training.model_params("DiT-T/8", False)
    assert dense["flops_per_step"] == bench_training.training_step_flops("DiT-T/8", dense_params, 2, routing=False)
    assert "HFU adds the recomputed forward" in (tmp_path / "bench.md").read_text()


def test_padded_sampling_gives_generates_latents():
    """The FID section's sampling loop (last batch padded to the compiled shape) draws and samples each seed as
    generation.generate does."""
    torch.manual_seed(0)
    net = EDMPrecond(get_model("DiT-T/8", bench_evaluation.IMAGENET_LATENT).eval())
    sampler = make_sampler(dict(name="edm", num_steps=2))
    latents, labels = bench_evaluation.sample_latents(net, range(5), 3, torch.device("cpu"), sampler, pad=True)
    decoded = []

    class Recording:
        def decode(self, x):
            decoded.append(x)
            return torch.zeros(len(x), 1, 1, 3, dtype=torch.uint8)

    _, want_labels = generate(net, range(5), sampler_kwargs=dict(name="edm", num_steps=2), decoder=Recording(),
                              batch_size=3, progress=False)
    assert sum(len(x) for x in decoded) == 5 and latents.shape == (5, 4, 32, 32)  # decoded per image on a CPU
    torch.testing.assert_close(latents, torch.cat(decoded), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(labels.numpy(), want_labels)


def test_fid_section_decodes_in_batches_of_64_and_compiles_one_batch_shape(monkeypatch, tmp_path, capsys):
    decoded = []
    real_decode = bench_evaluation.SDVAEDecoder.decode
    monkeypatch.setattr(bench_evaluation.SDVAEDecoder, "decode",
                        lambda self, x: decoded.append((len(x), self.decode_batch_size)) or real_decode(self, x))
    monkeypatch.setattr(bench_evaluation, "pool_features",
                        lambda inception, images, batch, progress: np.random.rand(len(images), 8))
    result = run_bench(monkeypatch, tmp_path, "--backbones", "DiT-T/8", "--sections", "fid", "--fid-samples", "67",
                       "--fid-steps", "1", "--fid-batch", "66", "--fid-compile", "--compile-backend", "eager",
                       "--vae", save_tiny_vae(tmp_path / "vae", 64))
    fid, = result["fid"]
    assert decoded == [(64, 64), (3, 64)]
    assert fid["padded_samples"] == 65 and fid["graphs"] == 1 and fid["frames"] == 1  # no recompile for 1 sample
    assert 0 < fid["sampling_first_batch_s"] < fid["sampling_s"]
    log = capsys.readouterr().out
    for stage in ("sampling", "decoding", "features", "statistics", "distance"):
        assert f"{stage} done in" in log
    assert "  sampling: 66/67 images" in log and "  sampling: 67/67 images" in log
    assert "  decoding: 64/67 images" in log


def test_a_fid_run_cut_short_leaves_its_stages_and_the_next_section_runs(monkeypatch, tmp_path):
    """A stage that raises keeps the stages before it in the JSON (saved after each one), the failure is
    recorded, the next section still runs, and the bench exits non-zero."""
    def broken(*args, **kwargs):
        partial = json.loads((tmp_path / "bench.json").read_text())["fid"][0]
        assert partial["stages_done"] == ["sampling", "decoding"]  # on disk before the next stage starts
        raise RuntimeError("features lost")

    monkeypatch.setattr(bench_evaluation, "pool_features", broken)
    with pytest.raises(SystemExit, match="failed section.*fid"):
        run_bench(monkeypatch, tmp_path, "--backbones", "DiT-T/8", "--sections", "fid", "loader",
                  "--fid-samples", "2", "--fid-steps", "1", "--fid-batch", "2",
                  "--vae", save_tiny_vae(tmp_path / "vae", 64), "--loader-samples", "8", "--loader-batch", "4",
                  "--loader-batches", "1", "--loader-workers", "0", "--loader-shape", "2", "4", "5")
    result = json.loads((tmp_path / "bench.json").read_text())
    fid, = result["fid"]
    assert fid["stages_done"] == ["sampling", "decoding"] and fid["decoding_s"] > 0 and "features_s" not in fid
    assert result["failed"] == {"fid": "RuntimeError: features lost"}
    assert result["loader"][0]["samples"] == 4
