"""The routes a probed model was trained with (tools/route_probe.py), and what they mean for its ranking.

A model trained with a route has learned to do without its blocks for the routed tokens: every candidate
route inside a trained one shows a damage near 0 there, which says what the training did, not what the
architecture tolerates. The probe reads the trained routes, records them, says so beside its suggestion, and
can leave the candidates inside them out (--exclude-inside-trained).

What each model tells: a run folder or checkpoint, its run config (model.params.routes when
model.params.enable_routing; train.routing_off_after; init_from). An exported folder, its config.json, which
`python -m tools.export` writes with the run's routes; one declaring none is taken as a dense run only when
its README.md is the model card tools.export writes for that config.json (a folder re-saved with
`routes=[]` loses its routes and that card). A diffusers transformer's config.json records no training: unknown.
"""
from routing_module import resolve_routes
from training.exported import model_card
from tread_utils.errors import UserError
from tread_utils.hub import CONFIG_NAME, read_config

EXCLUDE_OPTION = "--exclude-inside-trained"


def route_name(start: int, end: int, ratio: float) -> str:
    return f"{start}->{end} @ {ratio:g}"  # as the candidates are named (route_probe_measure.Candidate)


def described(routes, depth: int) -> list:
    """A config's routes in a model of `depth` blocks, as JSON rows (negative indices resolved)."""
    rows = []
    for r in resolve_routes(list(routes or []), depth):
        row = {"route": route_name(r.start_layer_idx, r.end_layer_idx, r.selection_ratio),
               "start": r.start_layer_idx, "end": r.end_layer_idx, "ratio": r.selection_ratio}
        if r.schedule.kind != "constant":
            row["schedule"] = r.schedule.kind
        rows.append(row)
    return rows


def unknown(reason: str) -> dict:
    return {"routes": None, "source": reason}


def from_run_config(cfg: dict, step: int, depth: int, where: str) -> dict:
    """{"routes": [rows] ([] for a dense run), "source": how it is known} from a checkpoint's run config."""
    params = cfg["model"]["params"]
    routes = described(params.get("routes") if params.get("enable_routing") else [], depth)
    notes = []
    off = (cfg.get("train") or {}).get("routing_off_after")
    if routes and off is not None and step > off:
        notes.append(f"routing off from step {off}: the last {step - off} of its {step} steps dense")
    init = cfg.get("init_from")
    if init:
        if not routes:
            return unknown(f"{where}: trained without routes from the weights of {init}, whose own routes the probe "
                           f"does not read; probe that model too")
        notes.append(f"started from the weights of {init}, whose own routes the probe does not read")
    return {"routes": routes, "source": "; ".join([where, *notes])}


def from_export(folder, depth: int, parameters: int) -> dict:
    """The same from an exported folder's config.json (see the module's docstring)."""
    config = read_config(folder / CONFIG_NAME)
    if config.get("enable_routing") and config.get("routes"):
        return {"routes": described(config["routes"], depth), "source": f"{folder}/{CONFIG_NAME}"}
    card = folder / "README.md"
    if card.is_file() and card.read_text() == model_card(config, parameters):
        return {"routes": [], "source": f"{folder}/{CONFIG_NAME} and the model card tools.export wrote with it"}
    return unknown(f"{folder}/{CONFIG_NAME} declares no routes, but its README.md is not the card tools.export "
                   f"writes with it: a folder re-saved with routes=[] looks the same; probe the run's checkpoint")


def containing(start: int, end: int, trained) -> str:
    """The trained route whose blocks hold blocks `start`..`end`, or None."""
    return next((t["route"] for t in trained["routes"] or [] if t["start"] <= start and end <= t["end"]), None)


def exclude_inside(candidates, trained: dict, model: str) -> tuple:
    """(the candidates not inside a trained route, the names of those left out)."""
    if trained["routes"] is None:
        raise UserError(f"{EXCLUDE_OPTION}: the routes {model} was trained with are unknown ({trained['source']})")
    kept = [c for c in candidates if containing(c.start, c.end, trained) is None]
    if not kept:
        raise UserError(f"{EXCLUDE_OPTION}: every candidate lies inside the trained route(s) "
                        f"{', '.join(t['route'] for t in trained['routes'])}; add routes outside them with --routes")
    return kept, [c.name for c in candidates if c not in kept]


def names(trained: dict) -> str:
    return ", ".join(t["route"] + (f" ({t['schedule']} schedule)" if "schedule" in t else "")
                     for t in trained["routes"])


def trained_line(result: dict):
    """One line: the trained routes, where they come from, and what they mean for the ranking and the
    suggestion; None for a probe recorded without them."""
    trained = result.get("trained_routes")
    if trained is None:
        return None
    if trained["routes"] is None:
        return (f"Trained routes: unknown ({trained['source']}). If the model was trained with routes, the candidates "
                f"inside them show less damage because of that training, not the architecture.")
    if not trained["routes"]:
        return (f"Trained routes: none ({trained['source']}): the damages compare the routes on a model trained "
                f"without routing, the case docs/route_probe.md validates the ranking on.")
    it = "it" if len(trained["routes"]) == 1 else "them"
    head = f"Trained routes: {names(trained)} ({trained['source']})"
    excluded = result.get("excluded_inside_trained")
    if excluded:
        return (f"{head}. The {len(excluded)} candidate(s) inside {it} were left out ({EXCLUDE_OPTION}); the others "
                f"are ranked, and those overlapping {it} are still helped by that training.")
    inside = [r for r in result["routes"] if r.get("inside_trained_route")]
    if not inside:
        return (f"{head}. No candidate lies inside {it}; those overlapping {it} are still helped by that training.")
    return (f"{head}. The {len(inside)} candidate(s) inside {it} show the damage of a model that learned to do "
            f"without those blocks, not the architecture's: for a ranking of the architecture probe a dense "
            f"checkpoint, or rerun with {EXCLUDE_OPTION} to rank only the others.")


def suggestion_caveat(result: dict) -> str:
    """What the trained routes mean for the suggestion, appended to its line ('' when nothing)."""
    trained = result.get("trained_routes")
    if trained is None or result.get("suggestion") is None:
        return ""
    if trained["routes"] is None:
        return " The trained routes are unknown: if it lies inside one, its low damage reflects that training."
    row = next(r for r in result["routes"] if r["route"] == result["suggestion"])
    if row.get("inside_trained_route"):
        return (f" It lies inside the trained route {row['inside_trained_route']}: its low damage reflects that "
                f"training, not the architecture.")
    return ""
