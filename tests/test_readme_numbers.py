"""Every number the README quotes equals the file or config it is quoted from, rounded as printed: the demo
table against the default runs' logs (docs/perf/default_*_digits_metrics.jsonl), the toy study's table against
its report (docs/results/study.md), the GPU targets against docs/perf/h200_check/, the route probe's table
against its validation JSON, and the settings in the prose and the differences table against the composed
configs; docs/performance.md's CPU tables against docs/perf/cpu.json and its H100 table against
docs/perf/h100_b2.json. A measurement-like number in the README's prose (a decimal, a thousands
separator, a K, % or x suffix) that no check here claims fails the test: quote it with its source and add
its check, or remove it."""
import functools
import json
import re
import statistics
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PERF = REPO / "docs" / "perf"
STUDY = (REPO / "docs" / "results" / "study.md").read_text()
PERFORMANCE = (REPO / "docs" / "performance.md").read_text()
DIFFUSERS = (REPO / "docs" / "diffusers.md").read_text()
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:[eE]-?\d+)?(?:K\b|%|x\b)?")


def close(text: str, value: float) -> bool:
    """`text` is `value` as printed: rounded to the decimals shown (a thousands comma, a K, % or x suffix
    allowed; a % is read as a fraction of 100)."""
    s = text.strip().replace(",", "")
    scale = 1.0
    if s.endswith("%"):
        s, scale = s[:-1], 0.01
    elif s.endswith("K"):
        s, scale = s[:-1], 1000.0
    s = s.removesuffix("x")
    decimals = len(s.partition(".")[2]) if "e" not in s.lower() else 12
    return abs(float(s) * scale - value) <= 0.5 * 10 ** -decimals * scale + 1e-12 * max(1.0, abs(value))


def cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(text: str, header_start: str) -> list:
    """The rows (header -> cell) of the markdown table whose header line starts with `header_start`."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(starts) == 1, f"{len(starts)} tables start with {header_start!r}"
    header, rows = cells(lines[starts[0]]), []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line))))
    assert rows, header_start
    return rows


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line), up to the next heading."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"^#", text[start:], flags=re.M)
    return text[start:start + following.start()] if following else text[start:]


def compare_rows() -> list:
    """The study's per-step comparison of tread with dit, three seeds each."""
    return table(section(STUDY, "### compare: tread 2->8 @ 0.5 against dit"),
                 "| step | FID dit (n=3) | FID tread 2->8 @ 0.5 (n=3) |")


def mean_std(text: str) -> tuple:
    mean, _, std = text.partition("±")
    return mean.strip(), std.split("(")[0].strip()


def assert_close(text: str, value: float, what: str):
    assert close(text, value), f"README says {text} for {what}; the file gives {value}"


# ------------------------------------------------------------------------------------------------------
# The demo table: the default runs' logs


def run_log(model: str) -> tuple:
    records = [json.loads(line) for line in (PERF / f"default_{model}_digits_metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = {r["step"]: r for r in records if "fid" in r}
    return train, evals


DEMO_HEADER = "| command | loss (first -> last log) |"


@pytest.mark.parametrize("model", ["tread", "dit"])
def test_demo_table_is_the_default_runs_logs(model):
    row = next(r for r in table(README, DEMO_HEADER) if r["command"] == f"`accelerate launch train.py model={model}`")
    train, evals = run_log(model)
    first, last = (s.strip() for s in row["loss (first -> last log)"].split("->"))
    assert_close(first, train[0]["loss"], f"{model}'s first logged loss")
    assert_close(last, train[-1]["loss"], f"{model}'s last logged loss")
    header = list(row)
    steps = [int(s.replace(",", "")) for s in re.findall(r"[\d,]+", header[2])]
    assert steps == [int(s.replace(",", "")) for s in re.findall(r"[\d,]+", header[3])] and len(steps) == 2
    for metric, column in (("fid", header[2]), ("class_acc", header[3])):
        for text, step in zip(row[column].split("/"), steps):
            assert_close(text, evals[step][metric], f"{model}'s {metric} at step {step}")
    nn_step = int(re.search(r"[\d,]+", header[4]).group().replace(",", ""))
    assert_close(row[header[4]], evals[nn_step]["nn_ratio"], f"{model}'s nn_ratio at {nn_step}")
    assert_close(row["steps/s (median)"], statistics.median(r["steps_per_sec"] for r in train),
                 f"{model}'s median steps/s")
    assert max(evals) == steps[-1], "the table's last evaluation is the run's last"


def test_demo_steps_are_the_digits_preset():
    """The table's evaluation steps are what `accelerate launch train.py model=tread` runs today: a preset
    changed without rerunning the demo fails here."""
    header = list(table(README, DEMO_HEADER)[0])
    steps = [int(s.replace(",", "")) for s in re.findall(r"[\d,]+", header[2])]
    cfg = composed("model=tread")
    assert steps == list(range(cfg.train.eval.eval_interval, cfg.train.max_steps + 1, cfg.train.eval.eval_interval))
    assert "evaluates it twice" in README and len(steps) == 2
    for model in ("tread", "dit"):
        train, _ = run_log(model)
        assert train[-1]["step"] == cfg.train.max_steps
        assert train[0]["lr"] == pytest.approx(cfg.train.optimizer.lr)


# ------------------------------------------------------------------------------------------------------
# The toy study's table: its report


def test_toy_study_table_is_the_report():
    rows = {r["configuration"]: r for r in table(README, "| configuration | FID at 3,000 steps |")}
    header = list(next(iter(rows.values())))
    last_step = int(re.search(r"[\d,]+", header[1]).group().replace(",", ""))
    per_step = {int(r["step"]): r for r in compare_rows()}
    assert last_step == max(per_step)
    alone = section(STUDY, "## Step cost with the machine to itself (one run at a time, no evaluation; median steps/s)")
    cost = {r["configuration"]: r for r in table(alone, "| part | configuration | runs | steps/s |")}
    equal = {r["configuration"]: r for r in table(STUDY, "| part | configuration | steps/s alone | minutes |")
             if r["part"] == "compare"}
    minutes = re.search(r"\(([\d.]+) min\)", header[3]).group(1)
    for readme_name, name, column in (("`dit`", "dit", "FID dit (n=3)"),
                                      ("`tread` 2 -> 8 at 0.5", "tread 2->8 @ 0.5", "FID tread 2->8 @ 0.5 (n=3)")):
        row = rows[readme_name]
        for text, source in zip(mean_std(row[header[1]]), mean_std(per_step[last_step][column])):
            assert_close(text, float(source), f"{name}'s FID at {last_step}")
        assert_close(row[header[2]], float(cost[name]["steps/s"]), f"{name}'s steps/s alone")
        assert equal[name]["minutes"] == minutes
        for text, source in zip(mean_std(row[header[3]]), mean_std(equal[name]["FID"])):
            assert_close(text, float(source), f"{name}'s FID at equal time")
        assert re.search(r"\(step (\d+)\)", row[header[3]]).group(1) == equal[name]["step"]


def level_until() -> int:
    """The last step up to which no per-step FID difference of the study has Welch p below 0.05."""
    level = 0
    for row in compare_rows():
        if float(row["FID Welch p"]) < 0.05:
            break
        level = int(row["step"])
    return level


# ------------------------------------------------------------------------------------------------------
# The GPU table: the benchmark's JSON


H200 = PERF / "h200_check"


def training_runs(name: str) -> dict:
    bench = json.loads((H200 / f"{name}.json").read_text())
    assert bench["device"] == "NVIDIA H200" and bench["dtype"] == "bf16"
    return {(r["code"], r["model"]): r for r in bench["training"] if r["mode"] in ("compiled", "published")}


def test_gpu_targets_table_is_the_check_output():
    rows = {row["#"]: row for row in table(README, "| # | measure | target | measured | device |")}
    assert list(rows) == [str(i) for i in range(1, 8)]
    xl2, b2 = training_runs("xl2"), training_runs("b2")
    dit, tread = xl2["ours", "dit"], xl2["ours", "tread"]
    assert dit["backbone"] == "DiT-XL/2" and (dit["batch"], dit["micro_batch"]) == (256, 128)
    assert_close(rows["1"]["measured"], dit["mfu"], "XL/2 dit MFU")
    bf16, = [r for r in json.loads((H200 / "xl2bf16.json").read_text())["training"] if r["model"] == "tread"]
    assert bf16["fp32_after_route"] is False and (bf16["backbone"], bf16["batch"]) == ("DiT-XL/2", 256)
    printed = re.fullmatch(r"([\d.]+) \(([\d.]+x) against ([\d.]+x)\): missed; with `model.params.fp32_after_route="
                           r"false`, ([\d.]+) \(([\d.]+x) against ([\d.]+x)\)", rows["2"]["measured"]).groups()
    for text, (run, key) in zip(printed, [(r, k) for r in (tread, bf16) for k in ("speedup_vs_bound", "speedup", "flop_bound")]):
        assert_close(text, run[key], f"XL/2 {key} (fp32_after_route {run['fp32_after_route']})")
    ours_over_paper = [runs["ours", m]["step_s"] / runs["paper", m]["step_s"] for runs in (xl2, b2) for m in ("dit", "tread")]
    printed = rows["3"]["measured"].removesuffix(": missed").split(", ")
    assert len(printed) == 4 and all(close(t, v) for t, v in zip(printed, ours_over_paper)), (printed, ours_over_paper)
    assert all(r["max_abs_output_difference"] == 0 for runs in (xl2, b2) for k, r in runs.items() if k[0] == "paper")
    fid, = json.loads((H200 / "fid.json").read_text())["fid"]
    total, *stages = NUMBER.findall(rows["4"]["measured"])
    assert_close(total, fid["seconds"], "FID-5K total")
    assert len(stages) == 5
    for text, stage in zip(stages, ("sampling", "decoding", "features", "statistics", "distance")):
        assert_close(text, fid[f"{stage}_s"], f"FID-5K {stage}")
    assert (fid["samples"], fid["heun_steps"], fid["backbone"], fid["compiled"]) == (5000, 40, "DiT-B/2", True)
    cuda = (H200 / "command3_logs.txt").read_text()
    passed = len(re.search(r"^(\.+)\s+\[100%\]$", cuda, re.M).group(1))
    assert rows["5"]["measured"] == f"{passed} passed" and cuda.rstrip().endswith("rc 0 after 57 s")
    suite, = json.loads((H200 / "suite.json").read_text())["suite"]
    seconds, memory = re.fullmatch(r"([\d.]+) s, (\d+) MB: memory missed", rows["6"]["measured"]).groups()
    assert (suite["samples"], suite["reference"]) == (50000, 10000) and suite["peak_host_mb"] > 2048
    assert_close(seconds, suite["seconds"], "ADM suite time")
    assert_close(memory, suite["peak_host_mb"], "ADM suite peak host memory")
    records = [json.loads(line) for line in (H200 / "train_metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert logged[-1]["step"] == 200 and any(r["step"] == 100 and "fid" in r for r in records)
    recompiles = max(r["recompiles_after_first_step"] for r in logged)
    graphs = {r["compiled_graphs"] for r in logged}
    assert rows["7"]["measured"] == f"{recompiles} recompiles, {graphs.pop()} graph" and not graphs
    assert all(row["device"] == "H200" for row in rows.values())
    for i in (1, 2, 3, 4):
        assert "NVIDIA H200" in (H200 / f"command{i}_summary.txt").read_text()


PROFILE_COLUMNS = {"matmul": "matmul", "attention": "attention", "adaLN/modulate + layer norm": "adaLN/modulate + layer norm",
                   "other elementwise": "other", "optimizer": "optimizer", "gather/scatter": "gather/scatter"}


def test_profile_table_is_the_xl2_json_less_its_listed_annotation_ranges():
    """docs/performance.md's profile table: each category of the JSON's profile less the annotation ranges its top
    entries list (`## Call CompiledFxGraph ##` in other, `...#AdamW.step` in optimizer); kernels: their sum."""
    rows = {r["model"]: r for r in json.loads((H200 / "xl2.json").read_text())["training"] if "profile" in r}
    for row in table(PERFORMANCE, "| | step | kernels | matmul |"):
        run = rows[row[""].strip("`")]
        ms = dict(run["profile"]["ms_by_category"])
        for entry in run["profile"]["top"]:
            if entry["name"].startswith("## "):
                ms["other"] -= entry["ms"]
            elif "#" in entry["name"]:
                ms["optimizer"] -= entry["ms"]
        assert_close(row["step"], run["step_s"] * 1000, "profiled variant's step")
        assert_close(row["kernels"], sum(ms.values()), "kernel time")
        for column, key in PROFILE_COLUMNS.items():
            assert_close(row[column], ms[key], f"{run['model']} {column}")


def test_h100_table_is_the_benchmark_json():
    bench = json.loads((PERF / "h100_b2.json").read_text())
    assert "H100" in bench["device"] and bench["dtype"] == "bf16"
    runs = {(r["code"], r["mode"], r["model"]): r for r in bench["training"]}
    rows = table(PERFORMANCE, "| code | mode | `dit` step (ms) |")
    assert len(rows) == len(runs) // 2
    for row in rows:
        code = {"ours": "ours", "authors'": "paper"}[row["code"]]
        mode = row["mode"].split(" (")[0]
        dit, tread = runs[(code, mode, "dit")], runs[(code, mode, "tread")]
        assert dit["backbone"] == tread["backbone"] == "DiT-B/2" and dit["batch"] == tread["batch"] == 256
        what = f"{code} {mode}"
        assert_close(row["`dit` step (ms)"], dit["step_s"] * 1000, f"{what} dit step")
        assert_close(row["`tread` step (ms)"], tread["step_s"] * 1000, f"{what} tread step")
        assert_close(row["`dit` MFU"], dit["mfu"], f"{what} dit MFU")
        assert_close(row["speed-up"], tread["speedup"], f"{what} speed-up")
        assert_close(row["FLOP bound"], tread["flop_bound"], f"{what} FLOP bound")
        assert_close(row["speed-up / bound"], tread["speedup_vs_bound"], f"{what} speed-up / bound")
    assert all(r["max_abs_output_difference"] == 0 for r in bench["training"] if r["code"] == "paper")


def diffusers_bench_rows() -> dict:
    """The committed `lab.bench_diffusers` rows at 1,024 image tokens, batch 2 (its family records), by arch."""
    rows = {}
    for path in sorted(PERF.glob("diffusers_*_cpu.json")):
        for r in json.loads(path.read_text())["rows"]:
            if r["tokens"] == 1024 and r["batch"] == 2 and "lora" not in path.name:
                assert r["arch"] not in rows, f"{r['arch']} is benched at 1,024 tokens twice"
                rows[r["arch"]] = dict(r, file=path.name)
    return rows


def test_diffusers_table_is_the_benchmark_json():
    """docs/diffusers.md's bench table: a row per family apply_tread supports, each from its committed bench record."""
    from lab.bench_diffusers import ARCHS
    from tread_diffusers.families import FAMILIES
    from tread_diffusers.tread import apply_tread  # noqa: F401  (importing registers every family)

    assert {cls for _, cls in ARCHS.values()} == set(FAMILIES), "lab.bench_diffusers.ARCHS names every family"
    bench = diffusers_bench_rows()
    assert set(bench) == set(ARCHS), "every family is benched at 1,024 tokens"
    runs = {name: bench[arch] for arch, (name, _) in ARCHS.items()}
    log = (PERF / "finetune_lora_digits.log").read_text()
    m = re.search(r"tokens (\d+), batch (\d+).*\n(?:.*\n)*step time: unrouted (\d+) ms, routed (\d+) ms .*speed-up "
                  r"([\d.]+)x, FLOP bound ([\d.]+)x .*speed-up / bound ([\d.]+)", log)
    runs["FLUX, the LoRA example"] = dict(arch="example", tokens=int(m[1]), unrouted_step_s=float(m[3]) / 1000,
                                          routed_step_s=float(m[4]) / 1000, speedup=float(m[5]),
                                          flop_bound=float(m[6]), speedup_vs_bound=float(m[7]))
    losses = [float(v) for v in re.findall(r"eval loss \(unrouted, held-out\) ([\d.]+)", log)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 2, losses  # the example learns
    rows = table(DIFFUSERS, "| family | image tokens | unrouted step (ms) |")
    assert [row["family"] for row in rows] == list(runs)
    for row in rows:
        run = runs[row["family"]]
        assert row["image tokens"] == str(run["tokens"]), row
        assert_close(row["unrouted step (ms)"], run["unrouted_step_s"] * 1000, f"{run['arch']} unrouted step")
        assert_close(row["routed step (ms)"], run["routed_step_s"] * 1000, f"{run['arch']} routed step")
        assert_close(row["speed-up"], run["speedup"], f"{run['arch']} speed-up")
        assert_close(row["FLOP bound"], run["flop_bound"], f"{run['arch']} FLOP bound")
        assert_close(row["speed-up / bound"], run["speedup_vs_bound"], f"{run['arch']} speed-up / bound")
    commands = re.sub(r"\\\n\s*", "", DIFFUSERS)  # continued lines joined
    for command in ("--archs flux flux2 chroma qwen krea2 sd3 pixart auraflow zimage lumina2 ernie --tokens-side 32",
                    "--archs wan ltx hunyuan cosmos kandinsky ltx2 minimax --tokens-side 16 --frames 4"):
        assert f"python -m lab.bench_diffusers {command}" in commands


def test_diffusers_family_table_is_the_benchmark_json():
    """docs/diffusers.md's family table: a row per family, its CPU speed-up / bound from the committed record."""
    from lab.bench_diffusers import ARCHS

    bench = diffusers_bench_rows()
    rows = table(DIFFUSERS, "| family | block lists, in route-index order |")
    by_class = {row["family"].split("`")[1]: row for row in rows}
    assert set(by_class) == {cls for _, cls in ARCHS.values()}
    for arch, (_, cls) in ARCHS.items():
        assert_close(by_class[cls]["CPU speed-up / bound"], bench[arch]["speedup_vs_bound"], f"{arch} speed-up / bound")


def test_route_probe_table_is_the_validation_json():
    found = json.loads((REPO / "docs" / "results" / "route_probe" / "validation" / "validation.json").read_text())
    checks = {r["step"]: r for r in found["placement"]}
    rows = table(README, "| checkpoint step | Spearman's rho, damage vs final FID |")
    assert {int(row["checkpoint step"]) for row in rows} == set(checks)
    for row in rows:
        check = checks[int(row["checkpoint step"])]
        assert check["routes"] == 9 and "9 placement routes" in README
        assert_close(row["Spearman's rho, damage vs final FID"], check["rho"], "rho of damage against FID")
        assert_close(row["permutation p"], check["p"], "its permutation p-value")
        assert_close(row["rho, FLOP speed-up alone vs final FID"], check["rho_speedup"], "rho of speed-up")
    probe = json.loads((REPO / "docs" / "results" / "route_probe" / "digits" / "probe.json").read_text())
    assert "step 1000" in probe["model"] and "a `dit` at step 1000 on the digits" in README
    assert "--target-speedup 1.3" in probe["command"] and "--target-speedup 1.3" in README


# ------------------------------------------------------------------------------------------------------
# docs/performance.md's CPU tables: docs/perf/cpu.json


@pytest.mark.parametrize("record, first", [("cpu.json", "backbone"), ("cpu_lightningdit.json", "backbone, alone")])
def test_cpu_training_table_is_the_benchmark_json(record, first):
    runs = {(r["backbone"], r["code"], r["mode"], r["model"]): r
            for r in json.loads((PERF / record).read_text())["training"]}
    rows = table(PERFORMANCE, f"| {first} | code | mode | dit step (ms) |")
    assert len(rows) == len(runs) // 2
    for row in rows:
        key = (row[first], row["code"], row["mode"].split(" (")[0])
        dit, tread = runs[(*key, "dit")], runs[(*key, "tread")]
        assert_close(row["dit step (ms)"], dit["step_s"] * 1000, f"{key} dit step")
        assert_close(row["tread step (ms)"], tread["step_s"] * 1000, f"{key} tread step")
        assert_close(row["speed-up"], tread["speedup"], f"{key} speed-up")
        assert_close(row["FLOP bound"], tread["flop_bound"], f"{key} FLOP bound")
        assert_close(row["speed-up / bound"], tread["speedup_vs_bound"], f"{key} speed-up / bound")


BESIDE_DIT = ["cpu_lightningdit_beside_dit.json", *(f"cpu_lightningdit_beside_dit_{run}.json" for run in (2, 3, 4))]


def test_lightningdit_beside_dit_table_is_the_four_records():
    rows = table(PERFORMANCE, "| run | backbone | dit step (ms) |")
    assert len(rows) == 2 * len(BESIDE_DIT)
    for row in rows:
        runs = {(r["backbone"], r["model"]): r
                for r in json.loads((PERF / BESIDE_DIT[int(row["run"]) - 1]).read_text())["training"]}
        dit, tread = runs[(row["backbone"], "dit")], runs[(row["backbone"], "tread")]
        where = f"run {row['run']} {row['backbone']}"
        assert_close(row["dit step (ms)"], dit["step_s"] * 1000, f"{where} dit step")
        assert_close(row["tread step (ms)"], tread["step_s"] * 1000, f"{where} tread step")
        assert_close(row["speed-up"], tread["speedup"], f"{where} speed-up")
        assert_close(row["speed-up / bound"], tread["speedup_vs_bound"], f"{where} speed-up / bound")


def test_cpu_sampling_table_is_the_benchmark_json():
    runs = {(r["backbone"], r["guidance"]): r for r in json.loads((PERF / "cpu.json").read_text())["sampling"]}
    rows = table(PERFORMANCE, "| backbone | guidance | images/s | NFE/image |")
    assert len(rows) == len(runs)
    for row in rows:
        kind = "unguided" if row["guidance"] == "unguided" else "cfg+interval" if "interval" in row["guidance"] else "cfg"
        run = runs[(row["backbone"], kind)]
        assert_close(row["images/s"], run["images_per_s"], f"{row['backbone']} {kind} images/s")
        assert_close(row["NFE/image"], run["nfe_per_image"], f"{row['backbone']} {kind} NFE")


# ------------------------------------------------------------------------------------------------------
# Numbers in the prose: settings from the configs, claims from the study


@functools.lru_cache(maxsize=None)
def composed(*overrides):
    """The config these overrides compose (cached: read only)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def imagenet():
    return composed("model=tread", "dataset=imagenet256")


# prose number -> (what it is, the value its source gives now)
PROSE = {
    "0.5": ("the default route's selection ratio", lambda: composed("model=tread").model.params.routes[0].selection_ratio),
    "0.1": ("chance over the digits' classes", lambda: 1 / composed().dataset.num_classes),
    "3,000": ("the toy study's last compared step", lambda: max(int(r["step"]) for r in compare_rows())),
    "2,500": ("the last step before any per-step FID difference has p < 0.05", level_until),
    "1e-4": ("the ImageNet preset's learning rate", lambda: imagenet().train.optimizer.lr),
    "0.9999": ("the ImageNet preset's EMA decay", lambda: imagenet().train.ema.decay),
    "400K": ("the ImageNet preset's steps", lambda: imagenet().train.max_steps),
    "50K": ("the ImageNet preset's evaluation interval; ADM's 50K samples", lambda: imagenet().train.eval.eval_interval),
    "5K": ("the ImageNet preset's FID sample count", lambda: imagenet().train.eval.fid_num_samples),
    "0.42": ("the diffusers version apply_tread is tested on", lambda: tested_diffusers()),
    "2.11": ("a torch whose compile check passed", lambda: compile_check_passed("2.11")),
    "2.14": ("a torch whose compile check passed", lambda: compile_check_passed("2.14")),
}


def compile_check_passed(minor: str) -> float:
    """The torch version of a committed compile-check log that shows one graph, no break and every test passed."""
    (log,) = PERF.glob(f"compile_check_torch{minor}.*.txt")
    text = log.read_text()
    assert re.search(r": 1 graph\(s\), 0 break\(s\)", text) and not re.search(r"break\(s\)[^\n]*first", text)
    assert re.search(rf"^torch {re.escape(minor)}\.\d+: \d+ passed, 0 failed, 0 errors$", text, re.M), log
    return float(minor)


def tested_diffusers() -> float:
    from tread_diffusers.tread import TESTED_DIFFUSERS

    assert len(TESTED_DIFFUSERS) == 1, "the README names one tested diffusers version"
    return float(TESTED_DIFFUSERS[0])


def prose(text: str) -> str:
    """The README without code, links' targets and tables (the results tables are checked cell by cell above,
    the differences table's settings against the configs below)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return "\n".join(line for line in text.split("\n") if not line.startswith("|"))


def test_prose_numbers_are_each_checked():
    measured_like = {n for n in NUMBER.findall(prose(README)) if re.search(r"[.,eEK%x]", n.rstrip(","))}
    unchecked = measured_like - set(PROSE)
    assert not unchecked, f"numbers in the README's prose with no check in this test: {sorted(unchecked)}"


@pytest.mark.parametrize("number", sorted(PROSE))
def test_prose_number_is_its_source(number):
    what, source = PROSE[number]
    assert number in NUMBER.findall(prose(README)), f"{number} ({what}) is no longer in the README: drop its check"
    assert_close(number, float(source()), what)


def test_settings_in_prose_are_the_presets():
    """The integers the README states as settings: the ImageNet batch, the demo model's shape, the route."""
    cfg = imagenet()
    assert cfg.train.general.batch_size == 256 and "(global batch 256," in README
    route = composed("model=tread").model.params.routes[0]  # the default route, as the README words it
    placed = f"{route.start_layer_idx} -> {route.end_layer_idx}"
    assert f"route {placed} at {route.selection_ratio:g}" in README
    assert f"the route {placed} at selection ratio {route.selection_ratio:g}" in README
    import dit

    digits = composed("model=tread")
    assert digits.dataset.backbone_type == "DiT-D/4" and "DiT-D/4 (12 blocks, 64 wide, 16 tokens)" in README
    shape = dit.DiT_models["DiT-D/4"]
    tokens = (digits.dataset.input_size // shape["patch_size"]) ** 2
    assert (shape["depth"], shape["hidden_size"], tokens) == (12, 64, 16)


# the differences table: (row, words the row says, config key of the ImageNet preset, its value)
DIFFERENCES = [
    ("initialisation", "`model.params.init=adaln_zero`", "model.params.init", "official"),
    ("model keys", "`cond_mode: adaln`", "model.params.cond_mode", "adaln"),
    ("model keys", "`learn_sigma: false`", "model.params.learn_sigma", False),
    ("latents", "`dataset.posterior_sampling=true`", "dataset.posterior_sampling", False),
    ("latents", "`dataset.random_flip=true`", "dataset.random_flip", False),
    ("global batch", "`train.general.grad_accum_steps`", "train.general.grad_accum_steps", 1),
    ("class dropout", "same probability (0.1)", "train.general.class_drop_prob", 0.1),
    ("TF32", "on (CUDA)", "train.tf32", True),
    ("compilation", "off; `train.compile=true`", "train.compile", False),
    ("optimizer", "lr 1e-4", "train.optimizer.lr", 1e-4),
    ("optimizer", "betas (0.9, 0.999)", "train.optimizer.betas", [0.9, 0.999]),
    ("optimizer", "eps 1e-8", "train.optimizer.eps", 1e-8),
    ("optimizer", "wd 0", "train.optimizer.weight_decay", 0),
    ("optimizer", "no warm-up", "train.optimizer.warmup_steps", 0),
    ("optimizer", "(none in both)", "train.optimizer.grad_clip", None),
    ("EMA", "| 0.9999 every step from step 0, identical on every rank |", "train.ema.decay", 0.9999),
    ("in-training sampling", "EDM Heun 40 steps", "train.eval.sampler.num_steps", 40),
    ("in-training sampling", "seeds 100000-", "train.eval.seed", 100000),
    ("in-training sampling", "`cfg_scales: [null]`", "train.eval.cfg_scales", [None]),
    ("in-training sampling", "`train.eval.fp32=true`", "train.eval.fp32", False),
    ("quantisation to uint8", "truncated | the same |", "dataset.quantize", "truncate"),
    ("seed", "`global_seed: 0`", "global_seed", 0),
    ("REPA", "| none (off) |", "repa.enabled", False),
    ("distribution", "| DDP through accelerate |", "train.distributed", "ddp"),
    ("backbone", "| DiT | DiT |", "model.backbone_type", "DiT-B/2"),
]


@pytest.mark.parametrize("row, words, key, value", DIFFERENCES, ids=[f"{d[0]}:{d[2]}" for d in DIFFERENCES])
def test_differences_table_states_the_defaults(row, words, key, value):
    """What the differences table says we train by default is what the ImageNet preset composes."""
    from omegaconf import OmegaConf

    line = next(line for line in README.split("\n") if line.startswith(f"| {row} |"))
    assert words in line, f"the differences table's row {row!r} no longer says {words!r}"
    got = OmegaConf.select(imagenet(), key)
    got = OmegaConf.to_object(got) if OmegaConf.is_config(got) else got
    assert got == value, f"{key} is {got!r}; the README's row {row!r} says {words!r}"


def test_differences_table_latent_scale_is_sd_vaes():
    from data.vae import SD_VAE_SCALE

    assert "already x 0.18215" in README and SD_VAE_SCALE == 0.18215


def test_close_reads_rounding_as_printed():
    """The comparison itself: a value off by more than the printed precision fails."""
    assert close("0.84", 0.8449) and not close("0.84", 0.846)
    assert close("51.6%", 0.51581) and not close("51.6%", 0.5172)
    assert close("1.156x", 1.15558) and close("3,000", 3000) and close("400K", 400000) and not close("400K", 800)
    assert close("1e-4", 1e-4) and not close("1e-4", 2e-3)


H100 = PERF / "h100_flux_check"


def test_h100_targets_table_is_the_check_output():
    rows = {row["#"]: row["measured"] for row in table(README, "| # | measure on one H100 |")}
    assert list(rows) == [str(i) for i in range(8, 15)]
    flux = json.loads((H100 / "flux.json").read_text())
    assert "H100" in flux["device"] and "cuDNN 91900" in flux["machine"] and flux["attention"].startswith("attention:")
    by_run = {(r["batch"], r["compiled"]): r for r in flux["rows"]}
    assert all(r["arch"] == "flux-dev" and r["tokens"] == 4096 and r["text_tokens"] == 512 for r in flux["rows"])
    for number, run in (("8", (1, False)), ("9", (1, True)), ("10", (2, False))):
        assert_close(rows[number].removesuffix(": missed"), by_run[run]["speedup_vs_bound"], f"FLUX row {number}")
    blocks = {r["model"]: r for r in json.loads((H100 / "xl2.json").read_text())["training"] if r["code"] == "ours"}
    paper = {r["model"]: r for r in json.loads((H100 / "xl2.json").read_text())["training"] if r["code"] == "paper"}
    model = {r["model"]: r for r in json.loads((H100 / "xl2model.json").read_text())["training"]}
    assert {r["compile_scope"] for r in blocks.values()} == {"blocks"} and model["tread"]["compile_scope"] == "model"
    assert_close(rows["12"], model["tread"]["speedup_vs_bound"], "XL/2 tread, whole-model compile")
    assert model["tread"]["fp32_after_route"] is not False
    printed = NUMBER.findall(rows["13"])
    assert_close(printed[0], blocks["dit"]["warmup_s"], "blocks dit warm-up")
    assert_close(printed[1], blocks["tread"]["warmup_s"], "blocks tread warm-up")
    ratios = [run["dit"]["peak_mem_mb"] / paper["dit"]["peak_mem_mb"] for run in (blocks, model)]
    assert all(close(t, v) for t, v in zip(NUMBER.findall(rows["14"]), ratios)), (rows["14"], ratios)
    for command in (1, 2):
        assert "NVIDIA H100" in (H100 / f"command{command}_summary.txt").read_text()


def test_flux_host_cost_proxy_sentences_are_its_record():
    rows = json.loads((PERF / "diffusers_flux_host_cpu.json").read_text())["rows"]
    eager, around, inside = rows
    assert all((row["blocks"], row["tokens"]) == (57, 16) for row in rows)
    assert [(row["compiled"], row["checkpoint"]) for row in rows] == [
        (False, "around blocks"), (True, "around blocks"), (True, "in graphs")]
    unrouted, routed, ratio = re.search(r"eager, unrouted (\d+) ms and routed (\d+) ms per step, so\s+routing costs "
                                        r"the host ([\d.]+) times", PERFORMANCE).groups()
    assert_close(unrouted, eager["unrouted_step_s"] * 1000, "proxy unrouted step")
    assert_close(routed, eager["routed_step_s"] * 1000, "proxy routed step")
    assert_close(ratio, eager["routed_step_s"] / eager["unrouted_step_s"], "proxy routed / unrouted")
    assert float(ratio) <= 1.1
    compiled = re.search(r"routed compiled step\s+costs the host (\d+) ms with the checkpoint around the compiled "
                         r"blocks .* and\s+(\d+) ms with it inside their graphs", PERFORMANCE, re.S).groups()
    assert_close(compiled[0], around["routed_step_s"] * 1000, "proxy compiled step, checkpoint around")
    assert_close(compiled[1], inside["routed_step_s"] * 1000, "proxy compiled step, checkpoint inside")
    assert "halves the host's time" in DIFFUSERS and inside["routed_step_s"] / around["routed_step_s"] < 0.55


def test_h100_command_seconds_are_their_summaries():
    rows = table(PERFORMANCE, "| H100 command | seconds | rows |")
    assert len(rows) == 2
    for number, row in enumerate(rows, 1):
        summary = (H100 / f"command{number}_summary.txt").read_text()
        assert re.search(rf"in {row['seconds']} s$", summary, re.M), (row, summary)
        for row_name, seconds in re.findall(r"(\w+) (\d+) s", row["rows"]):
            assert f"{row_name}: rc 0 after {seconds} s" in summary, (row_name, seconds)
