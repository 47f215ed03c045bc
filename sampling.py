"""The reusable core of sampling: checkpoints -> EMA denoiser, guidance, per-seed generation over processes.

Used by `sample.py` (the CLI) and by the in-training FID evaluation:

    net, cfg = load_sampling_net("results/run", device)          # or EDMPrecond(ema_model, sigma_data)
    net = build_guided_net(net, {"cfg_scale": 1.0}, class_drop_prob=...)
    images, labels = generate(net, range(5000), sampler_kwargs={"name": "edm", "num_steps": 40},
                              decoder=decoder_for(cfg["dataset"]), batch_size=64, device=device,
                              accelerator=accelerator)

Reproducibility: every sample owns a generator seeded by its seed (`StackedRandomGenerator`); its initial
noise, its random class label and its churn noise come from that generator alone. A seed's latents and
label are therefore the same whatever the batch size or the number of processes. Batches are the
consecutive slices of `batch_size` seeds and process r runs batches r, r + W, r + 2W, ... so one batch size
gives the same batches (hence bit-identical samples) for any number of processes.
"""
import contextlib
import math
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

import checkpoint as ckpt
from edm.guidance import ClassifierFreeGuidance, RoutingGuidance
from edm.sampler import StackedRandomGenerator, sampler_from_config
from errors import UserError
from objectives import build_denoiser

DEFAULT_SAMPLER = {"name": "edm", "num_steps": 40}  # the paper's in-training evaluation: Heun, 40 steps
MAX_SEED = 2 ** 63 - 1


# ----------------------------------------------------------------------------------------------------
# Seeds

def parse_seeds(spec) -> list:
    """'0-49999', '0,5,7', '0-9,20-29', an int, or a list of ints / such strings -> list of seeds, in order.

    Ranges are inclusive. Seeds are non-negative integers, each at most once.
    """
    if isinstance(spec, bool):
        raise UserError(f"seeds: expected e.g. 0-49999 or 0,5,7, got {spec!r}")
    parts = [spec] if isinstance(spec, (str, int)) else list(spec)
    seeds = []
    for part in parts:
        if isinstance(part, int) and not isinstance(part, bool):
            if part < 0:
                raise UserError(f"seeds: {part} is negative; seeds are integers >= 0")
            seeds.append(part)
            continue
        for item in str(part).replace(" ", "").split(","):
            lo, sep, hi = item.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise UserError(f"seeds: cannot read {item!r} in {spec!r}; write seeds like 0-49999, 0,5,7 or "
                                f"0-9,20-29 (non-negative integers, inclusive ranges)")
            lo_i, hi_i = int(lo), int(hi) if sep else int(lo)
            if hi_i < lo_i:
                raise UserError(f"seeds: range {item!r} ends before it starts")
            if hi_i > MAX_SEED or hi_i - lo_i >= 100_000_000:
                raise UserError(f"seeds: range {item!r} is too large")
            seeds.extend(range(lo_i, hi_i + 1))
    if not seeds:
        raise UserError(f"seeds: {spec!r} names no seed")
    seen = set()
    for seed in seeds:
        if seed in seen:
            raise UserError(f"seeds: seed {seed} appears more than once; duplicate seeds give duplicate samples")
        seen.add(seed)
    return seeds


# ----------------------------------------------------------------------------------------------------
# Checkpoints -> EMA denoiser

def net_from_state(state: dict, source="checkpoint", device="cpu"):
    """(the run's denoiser (EDMPrecond, or FlowPrecond for diffuser=rf) around the EMA backbone in eval mode on `device`, the run's config dict) from a loaded
    checkpoint dict (see `checkpoint.load_checkpoint`)."""
    from dit import get_model

    cfg = state.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg or "diffuser" not in cfg:
        raise UserError(f"checkpoint {source} holds no run config (model/diffuser); it was not written by train.py")
    if "ema" not in state:
        raise UserError(f"checkpoint {source} holds no EMA weights")
    try:
        model = get_model(cfg["model"]["backbone_type"], cfg["model"]["params"])
        diffuser = OmegaConf.create({"name": "edm", **cfg["diffuser"]})
    except (KeyError, TypeError) as e:
        raise UserError(f"checkpoint {source} has an incomplete model/diffuser config ({e!r} missing)") from None
    ckpt.load_model_state(model, state["ema"], source)
    model.requires_grad_(False).eval()
    net = build_denoiser(diffuser, model).to(device).eval()
    return net, cfg


def load_sampling_net(ckpt_path, device="cpu"):
    """(EMA denoiser `EDMPrecond` in eval mode on `device`, the run's resolved config as a dict).

    `ckpt_path` is a checkpoint file or a run directory (its newest checkpoint). Missing, corrupt or
    foreign checkpoints raise a one-line `UserError`.
    """
    path = ckpt.resolve_checkpoint(ckpt_path)
    return net_from_state(read_checkpoint(path), path, device)


def read_checkpoint(path) -> dict:
    """`checkpoint.load_checkpoint`, with advice for sampling rather than for resuming a run."""
    try:
        return ckpt.load_checkpoint(path)
    except UserError as e:
        message = str(e)
        cut = message.find(" - move it away")
        if cut < 0:
            raise
        raise UserError(message[:cut] + "; pass another checkpoint file or run directory") from None


# ----------------------------------------------------------------------------------------------------
# Guidance

def _backbone(net):
    """The innermost torch module of a (possibly wrapped) sampler net, and its backbone if any."""
    while not isinstance(net, torch.nn.Module) and hasattr(net, "net"):
        net = net.net
    return net, getattr(net, "model", net)


def build_guided_net(net, options: Optional[Mapping] = None, *, class_drop_prob: Optional[float] = None):
    """Wrap `net` with the guidance `options` asks for (a dict or config node; absent keys = off):

      cfg_scale (1.0)          classifier-free guidance scale; 1 = unguided (net returned unchanged)
      guidance_interval (None) [sigma_lo, sigma_hi]: apply CFG only at noise levels inside it
      routing_guidance         {scale: None = off, weak_ratio: 0.7, strong_ratio: 0.3}: TREAD routing guidance,
                               D = D_weak + scale (D_strong - D_weak) with routing forced at the two ratios

    `class_drop_prob` (the run's train.general.class_drop_prob): 0 with cfg_scale != 1 is refused, since a
    model trained without label dropout has no unconditional mode. Routing guidance needs TREAD routes.
    """
    options = options or {}
    get = options.get
    try:
        cfg_scale = float(1.0 if get("cfg_scale") is None else get("cfg_scale"))
    except (TypeError, ValueError):
        raise UserError(f"cfg_scale must be a number, got {get('cfg_scale')!r}") from None
    interval = get("guidance_interval")
    routing = get("routing_guidance") or {}
    routing_scale = routing.get("scale")
    if interval is not None:
        try:
            lo, hi = (float(v) for v in interval)
        except (TypeError, ValueError):
            raise UserError(f"guidance_interval must be [sigma_lo, sigma_hi] or null, got {interval!r}") from None
        if not 0 <= lo <= hi:
            raise UserError(f"guidance_interval must satisfy 0 <= sigma_lo <= sigma_hi, got [{lo}, {hi}]")
        interval = (lo, hi)
    if cfg_scale != 1.0:
        if class_drop_prob is not None and float(class_drop_prob) == 0.0:
            raise UserError(f"cfg_scale={cfg_scale} needs a model trained with class dropout, but this run used "
                            f"train.general.class_drop_prob=0 (no unconditional mode); use cfg_scale=1")
        num_classes = getattr(net, "num_classes", 0)
        if not num_classes:
            raise UserError("classifier-free guidance needs a class-conditional model")
        net = ClassifierFreeGuidance(net, cfg_scale, num_classes=num_classes, interval=interval)
    if routing_scale is not None:
        _, backbone = _backbone(net)
        router = getattr(backbone, "router", None)
        if router is None or not router.routes:
            raise UserError("routing guidance needs a model with TREAD routes (model.params.routes); this "
                            "checkpoint has none - set routing_guidance.scale=null")
        try:
            net = RoutingGuidance(net, weak_ratio=float(routing.get("weak_ratio", 0.7)),
                                  strong_ratio=float(routing.get("strong_ratio", 0.3)), scale=float(routing_scale))
        except (TypeError, ValueError) as e:
            raise UserError(f"routing_guidance: {e}") from None
    return net


# ----------------------------------------------------------------------------------------------------
# Samplers

class _DryNet:
    sigma_min, sigma_max = 0.0, math.inf

    @staticmethod
    def round_sigma(sigma):
        return torch.as_tensor(sigma)

    def __call__(self, x, sigma, class_labels=None, **kw):
        return x * 0.5


def make_sampler(sampler_kwargs: Optional[Mapping] = None):
    """The sampler described by `sampler_kwargs` = {'name': 'edm' | 'heun' | 'euler' | 'ablation', plus its
    settings}. Absent name / num_steps mean edm / 40; other absent or null settings, the sampler's own default.
    Unknown names, settings and bad values raise a one-line `UserError` here, before any model call (the
    sampler is run once on a 1-pixel dummy)."""
    given = {k: v for k, v in dict(sampler_kwargs or {}).items() if v is not None}
    kwargs = {**DEFAULT_SAMPLER, **given}
    name = str(kwargs.pop("name", "edm"))
    fn = sampler_from_config(name, **kwargs)
    try:
        fn(_DryNet(), torch.zeros(1, 1, 1, 1))
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise UserError(f"sampler {name!r}: {str(e).splitlines()[0]}") from None
    return fn


# ----------------------------------------------------------------------------------------------------
# Generation

@contextlib.contextmanager
def _eval_mode(net):
    module, _ = _backbone(net)
    modes = [(m, m.training) for m in module.modules()] if isinstance(module, torch.nn.Module) else []
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _latent_shape(net):
    _, backbone = _backbone(net)
    try:
        h, w = backbone.x_embedder.img_size
        return int(backbone.in_channels), int(h), int(w)
    except AttributeError:
        raise ValueError("cannot infer the latent shape of this net; pass latent_shape=(C, H, W)") from None


def _seed_routing(net, seed: int):
    """Restart every routing-guidance wrapper with the batch's first seed (token choices reproducible)."""
    while net is not None and not isinstance(net, torch.nn.Module):
        if isinstance(net, RoutingGuidance):
            net.seed = int(seed)
            net.reset()
        net = getattr(net, "net", None)


def _gather_to_main(obj, world: int, rank: int):
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


@torch.no_grad()
def generate(net, seeds: Sequence[int], *, sampler_kwargs: Optional[Mapping] = None, decoder, batch_size: int = 64,
             num_classes: Optional[int] = None, device=None, accelerator=None, class_labels=None,
             progress: bool = True, latent_shape=None):
    """Sample one image per seed; return (images uint8 numpy [N, H, W, 3], labels int64 numpy [N]) in the
    order of `seeds` on the main process, and (None, None) on the others.

    net:            a sampler net (`EDMPrecond`, possibly wrapped by `build_guided_net`); run in eval mode
                    (a module in training mode is switched to eval for the call and back afterwards).
    sampler_kwargs: {'name': 'edm', 'num_steps': 40, ...} (see `make_sampler`); None = EDM Heun, 40 steps.
    decoder:        latents -> uint8 [N, H, W, 3] (see `decoders`).
    accelerator:    an `accelerate.Accelerator`; its processes split the batches (process r runs batches
                    r, r + W, ...) and gather them to the main process after each round. None = one process.
    class_labels:   None = a random label per seed, drawn from the seed's generator; an int = that class for
                    every sample; a sequence = one label per seed.
    device:         where latents are drawn; default the device of the net's parameters.
    num_classes:    default `net.num_classes`; latent_shape: default (C, H, W) of the DiT backbone.
    """
    seeds = [int(s) for s in seeds]
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    if device is None:
        module, _ = _backbone(net)
        param = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
        device = param.device if param is not None else accelerator.device if accelerator is not None else "cpu"
    device = torch.device(device)
    if batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size}")
    num_classes = int(num_classes if num_classes is not None else getattr(net, "num_classes", 0))
    if num_classes < 1:
        raise UserError("generate() needs a class-conditional net (num_classes >= 1)")
    if class_labels is not None and np.ndim(class_labels) == 0:
        class_labels = int(class_labels)
    elif class_labels is not None:
        class_labels = [int(c) for c in class_labels]
        if len(class_labels) != len(seeds):
            raise UserError(f"class_labels has {len(class_labels)} entries for {len(seeds)} seeds")
    fixed = [class_labels] if isinstance(class_labels, int) else class_labels or []
    if any(not 0 <= c < num_classes for c in fixed):
        raise UserError(f"class labels must lie in 0..{num_classes - 1}, got {sorted(set(fixed))[:5]}")
    sampler = make_sampler(sampler_kwargs)
    shape = tuple(latent_shape) if latent_shape is not None else _latent_shape(net)

    starts = list(range(0, len(seeds), batch_size))
    rounds = math.ceil(len(starts) / world)
    all_images, all_labels = None, np.zeros(len(seeds), dtype=np.int64)
    bar = tqdm(total=len(seeds), disable=not progress or rank != 0, desc="sample", unit="img", dynamic_ncols=True)
    with _eval_mode(net):
        for r in range(rounds):
            item = None
            b = r * world + rank
            if b < len(starts):
                lo = starts[b]
                batch_seeds = seeds[lo:lo + batch_size]
                rnd = StackedRandomGenerator(device, batch_seeds)
                latents = rnd.randn([len(batch_seeds), *shape], device=device)
                labels = rnd.randint(num_classes, size=[len(batch_seeds)], device=device)
                if isinstance(class_labels, int):
                    labels = torch.full_like(labels, class_labels)
                elif class_labels is not None:
                    labels = torch.tensor(class_labels[lo:lo + batch_size], dtype=torch.long, device=device)
                _seed_routing(net, batch_seeds[0])
                x = sampler(net, latents, labels, randn_like=rnd.randn_like)
                images = decoder.decode(x.to(torch.float32))
                images = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
                item = (b, images.astype(np.uint8, copy=False), labels.cpu().numpy().astype(np.int64))
            for got in _gather_to_main(item, world, rank) or []:
                if got is None:
                    continue
                lo, images, labels = starts[got[0]], got[1], got[2]
                if all_images is None:  # filled in place: the main process holds the samples once
                    all_images = np.empty((len(seeds), *images.shape[1:]), dtype=np.uint8)
                all_images[lo:lo + len(images)] = images
                all_labels[lo:lo + len(labels)] = labels
                bar.update(len(labels))
    bar.close()
    return (all_images, all_labels) if rank == 0 else (None, None)


# ----------------------------------------------------------------------------------------------------
# Output files

def check_output_path(path, suffix: str, what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written: wrong suffix, a directory, a missing
    or unwritable parent directory (probed by creating and removing a temporary file there)."""
    import tempfile

    p = Path(str(path)).expanduser()
    if p.suffix.lower() != suffix:
        raise UserError(f"{what}={path} must end in {suffix}")
    if p.is_dir():
        raise UserError(f"{what}={path} is a directory; give a file name ending in {suffix}")
    parent = p.parent
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"cannot write {what}={path}: {parent} {problem}")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{p.name}.probe"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {what}={path}: directory {parent} is not writable ({e.strerror})") from None
    return p


def _atomic_write(path: Path, write):
    """write(file object) into a hidden temporary file next to `path`, fsync, then rename onto `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def save_samples_npz(path, images: np.ndarray, labels: np.ndarray) -> Path:
    """The ADM batch layout, written atomically: arr_0 uint8 [N, H, W, 3], arr_1 int64 [N]."""
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    return _atomic_write(Path(path), lambda f: np.savez(f, arr_0=images, arr_1=labels))


def image_grid(images: np.ndarray, max_images: int = 64) -> np.ndarray:
    """The first `max_images` of uint8 [N, H, W, 3] tiled row by row into a near-square uint8 image."""
    images = np.asarray(images)[:max(int(max_images), 1)]
    n, h, w, c = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * h, cols * w, c), dtype=np.uint8)
    for i, image in enumerate(images):
        r, k = divmod(i, cols)
        grid[r * h:(r + 1) * h, k * w:(k + 1) * w] = image
    return grid


def save_image_grid(path, images: np.ndarray, max_images: int = 64) -> Path:
    from PIL import Image

    grid = Image.fromarray(image_grid(images, max_images))
    return _atomic_write(Path(path), lambda f: grid.save(f, format="PNG"))
