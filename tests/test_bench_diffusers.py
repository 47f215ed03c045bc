"""lab/bench_diffusers.py on tiny sizes: a record with every architecture, a FLOP bound above 1, its table."""
import json

import pytest
import torch

pytest.importorskip("diffusers")
from lab import bench_diffusers  # noqa: E402
from tools.diffusers_toy import step_flops  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402


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


def test_bench_runs_the_other_families(tmp_path):
    """FLUX.2, Chroma, Qwen-Image, LTX-Video and HunyuanVideo (a few frames): each routed step needs fewer FLOPs."""
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "flux2", "chroma", "qwen", "ltx", "hunyuan", "--width", "64", "--depth", "4",
                          "--tokens-side", "4", "--frames", "2", "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    record = json.loads(out.read_text())
    assert [(r["arch"], r["tokens"]) for r in record["rows"]] == [("flux2", 16), ("chroma", 16), ("qwen", 16),
                                                                  ("ltx", 32), ("hunyuan", 32)]
    for row in record["rows"]:
        assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0


def test_bench_runs_zimage_and_krea2(tmp_path):
    """Z-Image (latents as a list per sample, captions after the image) and Krea2 (text before the image in every
    block): each routed step needs fewer FLOPs."""
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "zimage", "krea2", "--width", "64", "--depth", "4", "--tokens-side", "4",
                          "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["tokens"]) for r in rows] == [("zimage", 16), ("krea2", 16)]
    for row in rows:
        assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0


def test_bench_runs_cosmos_kandinsky_and_ltx2(tmp_path):
    """Cosmos, Kandinsky 5 (channels-last latents) and LTX-2 (with audio) at a few frames: each routed step needs
    fewer FLOPs."""
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "cosmos", "kandinsky", "ltx2", "--width", "64", "--depth", "4", "--tokens-side",
                          "4", "--frames", "2", "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    record = json.loads(out.read_text())
    assert [(r["arch"], r["tokens"]) for r in record["rows"]] == [("cosmos", 32), ("kandinsky", 32), ("ltx2", 32)]
    for row in record["rows"]:
        assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0


def test_bench_times_a_lora_step_on_an_int8_base(tmp_path):
    """--lora-int8: the base quantized by optimum-quanto (the default --quantizer) and frozen, the adapters the only
    weights the optimizer steps."""
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "flux", "--lora-int8", "--width", "64", "--depth", "4", "--tokens-side", "4",
                          "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    row, = json.loads(out.read_text())["rows"]
    assert row["base"] == "int8 (quanto) + LoRA"
    assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0


def test_quanto_int8_matmuls_count_as_the_float_ones():
    """The FLOP bound of --lora-int8 counts the quantized base's matmuls: as many FLOPs as the float base under the
    same adapters (torch's counter has no formula of its own for quanto's int8 matmul)."""
    from peft import LoraConfig

    plain, batch = bench_diffusers.model_and_batch("flux", 64, 4, 4, 2)
    plain.requires_grad_(False)
    plain.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v"]))
    quantized, _ = bench_diffusers.model_and_batch("flux", 64, 4, 4, 2)
    bench_diffusers.quantized_lora(quantized)
    inputs = batch()
    assert step_flops(quantized, inputs) == step_flops(plain, inputs) > 0


def test_flux_lora_proxy_writes_the_host_cost_record(tmp_path):
    """The FLUX.1-dev LoRA step's host-cost proxy: FLUX.1-dev's 19 + 38 blocks at width 64, LoRA on the
    attention projections, gradient checkpointing; a row with the fields a GPU row has, and one routed step
    profiled."""
    out = tmp_path / "proxy.json"
    bench_diffusers.main(["--flux-lora", "proxy", "--profile", "--rounds", "1", "--steps", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and len(record["rows"]) == 1
    row = record["rows"][0]
    assert (row["blocks"], row["tokens"], row["batch"], row["compiled"]) == (57, 16, 1, False)
    assert row["flop_bound"] > 1.0 and row["unrouted_step_s"] > 0 and row["routed_step_s"] > 0
    assert row["speedup_vs_bound"] == pytest.approx(row["speedup"] / row["flop_bound"])
    assert "| flux-dev depth, width 64, eager |" in out.with_suffix(".md").read_text()
    profiled = row["profile_routed"]
    assert profiled["busy_ms"] > 0 and profiled["top"] and "Row 1, one routed step profiled: kernels busy" in \
        out.with_suffix(".md").read_text()


def test_flux_lora_full_size_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(UserError, match="on a CPU run --flux-lora proxy") as err:
        bench_diffusers.main(["--flux-lora", "full"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flag", [["--checkpoint-outside"], ["--compile-mode", "reduce-overhead"]])
def test_flux_lora_compile_flags_need_compiled_blocks(flag):
    with pytest.raises(UserError, match=f"{flag[0]} applies to compiled blocks; add --compile on") as err:
        bench_diffusers.main(["--flux-lora", "proxy", "--compile", "off", *flag])
    assert "\n" not in str(err.value)


def test_table_gives_peak_memory_and_whether_cuda_graphs_replayed():
    """A GPU record's rows: their peak memory, and in reduce-overhead mode whether the steps replayed CUDA graphs
    or fell back (the failure line recorded); a CPU row's memory is a dash."""
    row = dict(arch="flux", params_m=11901.4, blocks=57, tokens=4096, batch=1, unrouted_step_s=0.532,
               routed_step_s=0.315, speedup=1.689, flop_bound=1.942, speedup_vs_bound=0.870)
    rows = [dict(row, compiled=True, compile_mode="reduce-overhead", cuda_graphs=True, peak_mem_mb=41234.6),
            dict(row, compiled=True, compile_mode="reduce-overhead", cuda_graphs=False,
                 cuda_graphs_failure="CUDA graphs failed: ...", peak_mem_mb=40001.0),
            dict(row, compiled=True, compile_mode="reduce-overhead", cuda_graphs=False, peak_mem_mb=None)]
    lines = bench_diffusers.to_markdown(dict(command="c", machine="m", rows=rows)).splitlines()[4:]
    assert lines[0].endswith("| speed-up / bound | peak memory (MB) |")
    assert lines[2].startswith("| flux, compiled blocks, mode reduce-overhead, CUDA graphs |")
    assert lines[2].endswith("| 0.870 | 41235 |")
    assert lines[3].startswith("| flux, compiled blocks, mode reduce-overhead, CUDA graphs failed |")
    assert lines[4].startswith("| flux, compiled blocks, mode reduce-overhead |") and lines[4].endswith("| - |")
