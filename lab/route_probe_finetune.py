"""The route probe's fine-tuning check: does the probe's route fine-tune as well as SimpleTuner's settings?

    python -m lab.route_probe_finetune pretrain --out /tmp/probe_flux
    python -m tools.route_probe /tmp/probe_flux/transformer --data /tmp/probe_flux/inputs.pt --out probe/ ...
    python -m lab.route_probe_finetune lora --model /tmp/probe_flux/transformer --routes 2:10:0.5,3:8:0.4 \
        --seeds 0,1,2 --budget 150 --out finetune/

`pretrain` trains the LoRA example's FLUX architecture (tools/diffusers_toy.py), deepened to 2 dual-stream + 10
single-stream blocks so that SimpleTuner's recommended routes fit, on the digits of classes 0-4 (16 x 16, 64
packed tokens, the class name as text), every weight trained; it writes the transformer and the probe's inputs
file: the fine-tuning data, digits 5-9. `lora` fine-tunes LoRA adapters on digits 5-9 with each route and seed
at equal FLOPs (`--budget` unrouted steps' worth: a route with FLOP-bound speed-up b trains round(budget x b)
steps) and reports the unrouted loss on held-out digits 5-9 before and after (fixed noise, as the example's), and
the quality of digits 5-9 sampled from each fine-tuned model and from the pretrained one (lab/route_probe_samples.py):
class accuracy and FID by the digits classifier.
"""
import json
import statistics
import sys
from pathlib import Path

import torch
from scipy import stats

from data.digits import load_digits_split
from evaluations.digits_classifier import load_digits_classifier
from tools.diffusers_toy import FixedTextEncoder, flow_matching_loss, pack, random_flux, step_flops
from tools.finetune_lora import add_lora, eval_loss
from lab.route_probe_samples import class_reference, real_digits, sample_digits, sample_labels, score
from tread_diffusers import apply_tread
from tread_utils.cli import ArgumentParser, positive_int
from tread_utils.errors import UserError, report_user_errors

RESOLUTION = 16
PRETRAIN_CLASSES, FINETUNE_CLASSES = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
WIDTH, HEADS, DUAL, SINGLE, TEXT_DIM = 64, 4, 2, 10, 32
SAMPLE_SEED = 0  # the samples' noise: the same for every route, seed and the pretrained model
# (key, column, format): the held-out loss, then the samples' scores, each compared with the first route by seed
LOSS = ("eval_loss_after", "held-out loss after", ".4f")
SAMPLES = (("class_accuracy", "class accuracy", ".3f"), ("fid", "FID", ".2f"))


def digits(split: str, classes) -> tuple:
    images, labels = load_digits_split(split, RESOLUTION)
    keep = torch.isin(labels, torch.tensor(classes))
    return pack(images[keep]), labels[keep]


def text_encoder():
    return FixedTextEncoder(TEXT_DIM, TEXT_DIM)


def train(model, params, latents, labels, steps: int, batch_size: int, lr: float, seed: int) -> list:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    encoder, g, losses = text_encoder(), torch.Generator().manual_seed(seed), []
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(labels), (batch_size,), generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_loss(model, latents[idx], *encoder(labels[idx]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def pretrain(args) -> None:
    out = Path(args.out)
    model = random_flux(1, WIDTH, HEADS, DUAL, SINGLE, TEXT_DIM, seed=0)
    torch.manual_seed(0)
    losses = train(model, list(model.parameters()), *digits("train", PRETRAIN_CLASSES), args.steps, 32, args.lr, 0)
    model.save_pretrained(out / "transformer")
    latents, labels = digits("train", FINETUNE_CLASSES)
    text, pooled = text_encoder()(labels)
    torch.save({"latents": latents, "text": text, "pooled": pooled}, out / "inputs.pt")
    print(f"pretrained {args.steps} steps on digits {PRETRAIN_CLASSES}: loss {statistics.mean(losses[:20]):.4f} -> "
          f"{statistics.mean(losses[-20:]):.4f}; wrote {out / 'transformer'} and {out / 'inputs.pt'} "
          f"({len(labels)} samples of digits {FINETUNE_CLASSES})")


def parse_routes(text: str) -> list:
    routes = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) != 3:
            raise UserError(f"--routes: {item!r} is not START:END:RATIO")
        routes.append({"start_layer_idx": int(fields[0]), "end_layer_idx": int(fields[1]),
                       "selection_ratio": float(fields[2])})
    return routes


def lora_run(args, route: dict, seed: int, test, sampling) -> dict:
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(args.model)
    torch.manual_seed(seed)
    params = add_lora(model, args.rank)
    latents, labels = digits("train", FINETUNE_CLASSES)
    before = eval_loss(model, *test)
    probe_batch = (latents[:args.batch_size], *text_encoder()(labels[:args.batch_size]))
    dense = step_flops(model, probe_batch)
    handle = apply_tread(model, {"routes": [route]})
    bound = dense / step_flops(model, probe_batch)
    steps = round(args.budget * bound)
    losses = train(model, params, latents, labels, steps, args.batch_size, args.lr, seed)
    handle.remove()
    return {"route": route_name(route), "seed": seed, "flop_speedup_bound": bound, "steps": steps,
            "train_loss_last20": statistics.mean(losses[-20:]), "eval_loss_before": before,
            "eval_loss_after": eval_loss(model, *test), **sampling(model)}


def route_name(route: dict) -> str:
    return f"{route['start_layer_idx']}->{route['end_layer_idx']} @ {route['selection_ratio']:g}"


def settings(args) -> dict:
    """What makes runs comparable: runs accumulate in --out only under the same settings."""
    return {"model": str(Path(args.model).resolve()), "budget": args.budget, "batch_size": args.batch_size,
            "rank": args.rank, "lr": args.lr, "samples_per_class": args.samples_per_class,
            "sample_steps": args.sample_steps, "sample_seed": SAMPLE_SEED}


def sampler(args):
    """fn(model) -> class accuracy and FID of `--samples-per-class` digits of each fine-tuned class, drawn from the
    same noise whatever the model."""
    classifier = load_digits_classifier(device="cpu")
    reference = class_reference(classifier, FINETUNE_CLASSES)
    labels = sample_labels(FINETUNE_CLASSES, args.samples_per_class)
    tokens = (RESOLUTION // 2) ** 2

    def sampling(model) -> dict:
        images = sample_digits(model, text_encoder(), labels, tokens, SAMPLE_SEED, args.sample_steps)
        return score(images, labels, classifier, reference)
    return sampling, classifier, reference


def baselines(args, sampling, classifier, reference) -> dict:
    """The pretrained model's samples (digits it never saw) and real training digits, scored the same way."""
    from diffusers import FluxTransformer2DModel

    images, labels = real_digits(FINETUNE_CLASSES, args.samples_per_class)
    return {"pretrained": sampling(FluxTransformer2DModel.from_pretrained(args.model)),
            "real_train_digits": score(images, labels, classifier, reference),
            "reference_count": reference["count"]}


def lora(args) -> None:
    routes, seeds = parse_routes(args.routes), [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    saved = out / "finetune.json"
    # runs accumulate in --out, one saved per route and seed, so a long comparison runs in chunks and a killed
    # command redoes only the run it was in
    earlier = json.loads(saved.read_text()) if saved.is_file() else {"settings": settings(args), "commands": [],
                                                                       "runs": []}
    if earlier.get("settings") != settings(args):
        raise UserError(f"--out {out} holds runs made with other settings ({earlier.get('settings')}); give the same "
                        f"options or another --out")
    earlier["commands"] = list(dict.fromkeys(earlier["commands"] + [args.command]))
    fewest = min(torch.bincount(digits("train", FINETUNE_CLASSES)[1])[list(FINETUNE_CLASSES)]).item()
    if args.samples_per_class > fewest:
        raise UserError(f"--samples-per-class {args.samples_per_class}: the real digits it is compared with have "
                        f"{fewest} training images in the rarest class; give at most that")
    test_latents, test_labels = digits("test", FINETUNE_CLASSES)
    test = (test_latents, *text_encoder()(test_labels))
    sampling, classifier, reference = sampler(args)
    out.mkdir(parents=True, exist_ok=True)
    if "before" not in earlier:
        earlier["before"] = baselines(args, sampling, classifier, reference)
        save(out, earlier)
    done = {(r["route"], r["seed"]) for r in earlier["runs"]}
    for route in routes:
        for seed in seeds:
            if (route_name(route), seed) in done:
                print(f"{route_name(route)} seed {seed}: already in {saved}", flush=True)
                continue
            r = lora_run(args, route, seed, test, sampling)
            earlier["runs"].append(r)
            save(out, earlier)
            print(f"{r['route']} seed {seed}: {r['steps']} steps (bound {r['flop_speedup_bound']:.3f}x), held-out "
                  f"loss {r['eval_loss_before']:.4f} -> {r['eval_loss_after']:.4f}, class accuracy "
                  f"{r['class_accuracy']:.3f}, FID {r['fid']:.2f}", flush=True)
    print((out / "finetune.md").read_text())


def save(out: Path, results: dict) -> None:
    (out / "finetune.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "finetune.md").write_text("\n".join(report(results)) + "\n")


def compared(runs, name: str, first: str, key: str, spec: str) -> list:
    """Cells for one route and metric: mean ± std over seeds, the per-seed values, the mean difference from route
    `first` paired by seed and its paired t-test p."""
    mine = {r["seed"]: r[key] for r in runs if r["route"] == name}
    theirs = {r["seed"]: r[key] for r in runs if r["route"] == first}
    values, paired = [mine[s] for s in sorted(mine)], sorted(set(mine) & set(theirs))
    spread = statistics.stdev(values) if len(values) > 1 else float("nan")
    diff = statistics.mean(mine[s] - theirs[s] for s in paired) if paired else float("nan")
    p = stats.ttest_rel([mine[s] for s in paired], [theirs[s] for s in paired]).pvalue \
        if name != first and len(paired) > 1 else float("nan")
    return [f"{statistics.mean(values):{spec}} ± {spread:{spec}}", ", ".join(f"{v:{spec}}" for v in values),
            f"{diff:+{spec}}", f"{p:.3g}"]


def report(results: dict) -> list:
    runs, s, before = results["runs"], results["settings"], results["before"]
    names = list(dict.fromkeys(r["route"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    n = s["samples_per_class"] * len(FINETUNE_CLASSES)
    lines = ["# LoRA fine-tuning at equal FLOPs", "", "Commands:", "", *[f"    {c}" for c in results["commands"]], "",
             f"LoRA fine-tuning on digits {FINETUNE_CLASSES} for {s['budget']} unrouted steps' FLOPs per route, "
             f"mean ± std over seeds {seeds}.", "",
             f"Difference: this route minus {names[0] if names else '-'}, paired by seed (same LoRA initialisation "
             "and batch order); p: paired t-test (scipy.stats.ttest_rel).", "",
             f"Held-out loss: unrouted, on the held-out digits {FINETUNE_CLASSES}, fixed noise; before fine-tuning "
             f"{runs[0]['eval_loss_before']:.4f}." if runs else "No runs yet.", "",
             f"| route | speed-up bound | steps | {LOSS[1]} | per seed | difference | p |", "|---|---|---|---|---|---|---|"]
    for name in names:
        one = next(r for r in runs if r["route"] == name)
        lines.append(f"| {name} | {one['flop_speedup_bound']:.3f}x | {one['steps']} | "
                     + " | ".join(compared(runs, name, names[0], *LOSS[::2])) + " |")
    lines += ["", f"Samples: {s['samples_per_class']} per class ({n}), the class name as text, no guidance, Euler on "
              f"the flow ODE in {s['sample_steps']} steps from the same noise (seed {s['sample_seed']}) for every "
              "model. Class accuracy: the fraction the digits classifier reads as the digit asked for (chance 0.1). "
              f"FID: digits classifier features against the {before['reference_count']} held-out digits of "
              f"{FINETUNE_CLASSES}.", "",
              "| model | " + " | ".join(f"{c} | per seed | difference | p" for _, c, _ in SAMPLES) + " |",
              "|---|" + "---|---|---|---|" * len(SAMPLES)]
    for label, row in (("pretrained, before fine-tuning", before["pretrained"]),
                       (f"real training digits ({n})", before["real_train_digits"])):
        lines.append(f"| {label} | " + " | ".join(f"{row[k]:{spec}} | | |" for k, _, spec in SAMPLES) + " |")
    for name in names:
        lines.append(f"| {name} | " + " | ".join(" | ".join(compared(runs, name, names[0], k, spec))
                                                for k, _, spec in SAMPLES) + " |")
    return lines


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lab.route_probe_finetune", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    pre = sub.add_parser("pretrain")
    pre.add_argument("--out", required=True)
    pre.add_argument("--steps", type=positive_int, default=600)
    pre.add_argument("--lr", type=float, default=1e-3)
    tune = sub.add_parser("lora")
    tune.add_argument("--model", required=True, help="the transformer folder `pretrain` wrote")
    tune.add_argument("--routes", required=True, help="START:END:RATIO,... (one LoRA run per route and seed)")
    tune.add_argument("--seeds", default="0,1,2")
    tune.add_argument("--budget", type=positive_int, default=150, help="FLOPs of this many unrouted steps")
    tune.add_argument("--batch-size", type=positive_int, default=16)
    tune.add_argument("--rank", type=positive_int, default=8)
    tune.add_argument("--lr", type=float, default=2e-3)
    tune.add_argument("--samples-per-class", type=positive_int, default=50,
                      help="digits drawn per fine-tuned class from each model, scored by the digits classifier")
    tune.add_argument("--sample-steps", type=positive_int, default=10, help="Euler steps of the flow ODE")
    tune.add_argument("--out", required=True)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = "python -m lab.route_probe_finetune " + " ".join(argv)
    pretrain(args) if args.what == "pretrain" else lora(args)


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and leaves the other core to the machine
    report_user_errors(main)()
