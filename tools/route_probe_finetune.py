"""The route probe's fine-tuning check: does the probe's route fine-tune as well as SimpleTuner's settings?

    python -m tools.route_probe_finetune pretrain --out /tmp/probe_flux
    python -m tools.route_probe /tmp/probe_flux/transformer --data /tmp/probe_flux/inputs.pt --out probe/ ...
    python -m tools.route_probe_finetune lora --model /tmp/probe_flux/transformer --routes 2:10:0.5,3:8:0.4 \
        --seeds 0,1,2 --budget 150 --out finetune/

`pretrain` trains the LoRA example's FLUX architecture (tools/diffusers_toy.py), deepened to 2 dual-stream + 10
single-stream blocks so that SimpleTuner's recommended routes fit, on the digits of classes 0-4 (16 x 16, 64
packed tokens, the class name as text), every weight trained; it writes the transformer and the probe's inputs
file: the fine-tuning data, digits 5-9. `lora` fine-tunes LoRA adapters on digits 5-9 with each route and seed
at equal FLOPs (`--budget` unrouted steps' worth: a route with FLOP-bound speed-up b trains round(budget x b)
steps) and reports the unrouted loss on held-out digits 5-9 before and after (fixed noise, as the example's).
"""
import json
import statistics
import sys
from pathlib import Path

import torch
from scipy import stats

from backbones.diffusers_tread import apply_tread
from data.digits import load_digits_split
from tools.diffusers_toy import FixedTextEncoder, flow_matching_loss, pack, random_flux, step_flops
from tools.finetune_lora import add_lora, eval_loss
from tread_utils.cli import ArgumentParser, positive_int
from tread_utils.errors import UserError, report_user_errors

RESOLUTION = 16
PRETRAIN_CLASSES, FINETUNE_CLASSES = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
WIDTH, HEADS, DUAL, SINGLE, TEXT_DIM = 64, 4, 2, 10, 32


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


def lora_run(args, route: dict, seed: int, test) -> dict:
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
    return {"route": f"{route['start_layer_idx']}->{route['end_layer_idx']} @ {route['selection_ratio']:g}",
            "seed": seed, "flop_speedup_bound": bound, "steps": steps, "train_loss_last20": statistics.mean(losses[-20:]),
            "eval_loss_before": before, "eval_loss_after": eval_loss(model, *test)}


def lora(args) -> None:
    routes, seeds = parse_routes(args.routes), [int(s) for s in args.seeds.split(",")]
    test_latents, test_labels = digits("test", FINETUNE_CLASSES)
    test = (test_latents, *text_encoder()(test_labels))
    out = Path(args.out)
    saved = out / "finetune.json"
    # runs accumulate in --out, so a long comparison runs in chunks (one route per command) and ends in one table
    earlier = json.loads(saved.read_text()) if saved.is_file() else {"commands": [], "runs": []}
    runs, commands = earlier["runs"], earlier["commands"] + [args.command]
    for route in routes:
        for seed in seeds:
            runs.append(lora_run(args, route, seed, test))
            r = runs[-1]
            print(f"{r['route']} seed {seed}: {r['steps']} steps (bound {r['flop_speedup_bound']:.3f}x), held-out "
                  f"loss {r['eval_loss_before']:.4f} -> {r['eval_loss_after']:.4f}", flush=True)
    names = list(dict.fromkeys(r["route"] for r in runs))
    lines = ["# LoRA fine-tuning at equal FLOPs", "", "Commands:", "", *[f"    {c}" for c in commands], "",
             f"Held-out loss (unrouted, digits {FINETUNE_CLASSES}, fixed noise) after LoRA fine-tuning of "
             f"{args.budget} unrouted steps' FLOPs, mean ± std over seeds {seeds}.", "",
             f"Difference: this route minus {names[0]}, paired by seed (same LoRA initialisation and batch order); "
             "p: paired t-test (scipy.stats.ttest_rel).", "",
             "| route | speed-up bound | steps | held-out loss after | per seed | difference | p |",
             "|---|---|---|---|---|---|---|"]
    first = {r["seed"]: r["eval_loss_after"] for r in runs if r["route"] == names[0]}
    for name in names:
        mine = {r["seed"]: r for r in runs if r["route"] == name}
        after = [r["eval_loss_after"] for r in mine.values()]
        spread = statistics.stdev(after) if len(after) > 1 else float("nan")
        paired = sorted(set(mine) & set(first))
        diff = [mine[s]["eval_loss_after"] - first[s] for s in paired]
        p = stats.ttest_rel([mine[s]["eval_loss_after"] for s in paired], [first[s] for s in paired]).pvalue \
            if name != names[0] and len(paired) > 1 else float("nan")
        one = next(iter(mine.values()))
        lines.append(f"| {name} | {one['flop_speedup_bound']:.3f}x | {one['steps']} | {statistics.mean(after):.4f} ± "
                     f"{spread:.4f} | {', '.join(f'{a:.4f}' for a in after)} | "
                     f"{statistics.mean(diff) if diff else float('nan'):+.4f} | {p:.3g} |")
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"commands": commands, "runs": runs}, indent=1) + "\n")
    (out / "finetune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tools.route_probe_finetune", description=__doc__.split("\n\n")[0])
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
    tune.add_argument("--out", required=True)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = "python -m tools.route_probe_finetune " + " ".join(argv)
    pretrain(args) if args.what == "pretrain" else lora(args)


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast and leaves the other core to the machine
    report_user_errors(main)()
