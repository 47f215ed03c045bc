"""Per-seed generation over processes, with guidance: the core that `sample.py` and the in-training
evaluation share.

    net, cfg = load_sampling_net("results/run", device)          # training.checkpoint; or EDMPrecond(ema, ...)
    net = build_guided_net(net, {"cfg_scale": 1.0}, class_drop_prob=...)
    images, labels = generate(net, range(5000), sampler_kwargs={"name": "edm", "num_steps": 40},
                              decoder=decoder_for(cfg["dataset"]), batch_size=64, device=device,
                              accelerator=accelerator)
    save_samples_npz("samples.npz", images, labels)              # on the main process

Reproducibility: every sample owns a generator seeded by its seed (`StackedRandomGenerator`); its initial
noise, its random class label and its churn noise come from that generator alone. A seed's latents and
label are therefore the same whatever the batch size or the number of processes, but not whatever the
device type: CPU and CUDA generators give different streams for one seed, so a GPU run's images differ from
a CPU run's. Batches are the
consecutive slices of `batch_size` seeds and process r runs batches r, r + W, r + 2W, ... so one batch size
gives the same batches (hence bit-identical samples) for any number of processes.
"""
import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from edm.guidance import ClassifierFreeGuidance, NetWrapper, PathDropGuidance, RoutingGuidance
from edm.sampler import SAMPLERS as EDM_SAMPLERS
from edm.sampler import StackedRandomGenerator, bind_sampler
from generation.progress import SamplingProgress
from rectified_flow import flow_sampler
from tread_utils.distributed import gather_to_main
from tread_utils.errors import UserError
from tread_utils.files import atomic_write

DEFAULT_SAMPLER = {"name": "edm", "num_steps": 40}  # the paper's in-training evaluation: Heun, 40 steps
# sampler.name -> function: EDM's samplers, and Euler/Heun on the velocity ODE for diffuser=rf runs
SAMPLERS = {**EDM_SAMPLERS, "flow": flow_sampler}


# ----------------------------------------------------------------------------------------------------
# Guidance

def _backbone(net):
    """(the denoiser under any guidance wrappers, its backbone: the `model` of EDMPrecond or FlowPrecond, also
    through torch.compile's wrapper, or the denoiser itself for a bare net)."""
    denoiser = net.denoiser if isinstance(net, NetWrapper) else net
    return denoiser, getattr(denoiser, "model", denoiser)


ROUTING_GUIDANCE_KEYS = ("scale", "weak_ratio", "strong_ratio")
PATH_DROP_GUIDANCE_KEYS = ("scale",)


def _refuse_unknown(options: Mapping, accepted, what: str):
    """A misspelt option would otherwise be ignored. (The top level is not checked: sample.py passes its
    whole config, which the schema has already checked.)"""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise UserError(f"unknown {what}(s) {unknown}; accepted: {', '.join(accepted)}")


def build_guided_net(net, options: Optional[Mapping] = None, *, class_drop_prob: Optional[float] = None):
    """Wrap `net` with the guidance `options` asks for (a dict or config node; absent keys = off):

      cfg_scale (1.0)          classifier-free guidance scale; 1 = unguided (net returned unchanged)
      guidance_interval (None) [sigma_lo, sigma_hi]: apply CFG only at noise levels inside it
      routing_guidance         {scale: None = off, weak_ratio: 0.7, strong_ratio: 0.3}: TREAD routing guidance,
                               D = D_weak + scale (D_strong - D_weak) with routing forced at the two ratios
      path_drop_guidance       {scale: None = off}: SPRINT's path-drop guidance, D = D_weak + scale (D - D_weak)
                               with the deep path of every route that can drop it dropped in the weak pass; it follows
                               guidance_interval too

    `class_drop_prob` (the run's train.general.class_drop_prob): not 0 with cfg_scale != 1, since a model
    trained without label dropout has no unconditional mode (the command refuses it: `guidance_needs_dropout`).
    Routing guidance needs routes, path-drop guidance a route whose fusion can drop its deep path (SPRINT's).
    """
    options = options or {}
    get = options.get
    cfg_scale = float(1.0 if get("cfg_scale") is None else get("cfg_scale"))
    interval = get("guidance_interval")  # checked at the entry point (training.config_check)
    routing = get("routing_guidance") or {}
    _refuse_unknown(routing, ROUTING_GUIDANCE_KEYS, "routing_guidance key")
    path_drop = get("path_drop_guidance") or {}
    _refuse_unknown(path_drop, PATH_DROP_GUIDANCE_KEYS, "path_drop_guidance key")
    _, backbone = _backbone(net)
    abilities = {"routing": ("a model with TREAD routes (model.params.routes)",
                             bool(getattr(getattr(backbone, "router", None), "routes", ()))),
                 "path-drop": ("a route whose fusion can drop its deep path (e.g. fusion=sprint)",
                               bool(getattr(backbone, "droppable", ())))}
    for (kind, (need, able)), given in zip(abilities.items(), (routing, path_drop)):
        if given.get("scale") is not None and not able:
            raise UserError(f"{kind} guidance needs {need}; this model has none: set "
                            f"{kind.replace('-', '_')}_guidance.scale=null")
    routing_scale = routing.get("scale")
    if interval is not None:
        lo, hi = (float(v) for v in interval)
        assert 0 <= lo <= hi, f"guidance_interval {interval}"
        interval = (lo, hi)
    if cfg_scale != 1.0:
        assert class_drop_prob is None or class_drop_prob > 0, "guidance without class dropout: refused at the entry point"
        net = ClassifierFreeGuidance(net, cfg_scale, num_classes=net.num_classes, interval=interval)
    if routing_scale is not None:
        net = RoutingGuidance(net, weak_ratio=float(routing.get("weak_ratio", 0.7)),
                              strong_ratio=float(routing.get("strong_ratio", 0.3)), scale=float(routing_scale))
    if path_drop.get("scale") is not None:
        net = PathDropGuidance(net, float(path_drop["scale"]), interval=interval)
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
    """The sampler described by `sampler_kwargs` = {'name': one of `SAMPLERS`, plus its
    settings}. Absent name / num_steps mean edm / 40; other absent or null settings, the sampler's own default.
    Unknown names, settings and bad values raise a one-line `UserError` here, before any model call (the
    sampler is run once on a 1-pixel dummy)."""
    given = {k: v for k, v in dict(sampler_kwargs or {}).items() if v is not None}
    kwargs = {**DEFAULT_SAMPLER, **given}
    name = str(kwargs.pop("name", "edm"))
    if name not in SAMPLERS:
        raise UserError(f"unknown sampler {name!r}; choose one of {', '.join(sorted(SAMPLERS))}")
    lo, hi = kwargs.get("sigma_min"), kwargs.get("sigma_max")
    if lo is not None and not (lo > 0 and (hi is None or lo < hi)):
        raise UserError(f"sampler {name!r}: sigma_min={lo} must be > 0 and below sigma_max={hi}; "
                        f"e.g. sigma_min=0.002 sigma_max=80")
    fn = bind_sampler(name, SAMPLERS[name], **kwargs)
    try:
        fn(_DryNet(), torch.zeros(1, 1, 1, 1), randn_like=torch.zeros_like)  # no draw from the global stream
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise UserError(f"sampler {name!r}: {str(e).splitlines()[0]}") from None
    return fn


def count_network_evaluations(sampler_kwargs: Optional[Mapping] = None) -> int:
    """Network evaluations (NFE) per sample of a sampler setting, counted by running it on a dry net."""
    calls = []

    class Counting(_DryNet):
        def __call__(self, x, sigma, class_labels=None, **kw):
            calls.append(1)
            return super().__call__(x, sigma, class_labels, **kw)

    make_sampler(sampler_kwargs)(Counting(), torch.zeros(1, 1, 1, 1), randn_like=torch.zeros_like)
    return len(calls)


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


@dataclass
class Samples:
    """What `generate` returns on every process: the rows this process holds, images uint8 [n, H, W, 3] and
    labels int64 [n], and their positions in `seeds`, indices int64 [n]. Unpacks as `images, labels`."""
    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray

    def __iter__(self):
        return iter((self.images, self.labels))


def _no_samples() -> Samples:
    return Samples(np.zeros((0, 0, 0, 3), dtype=np.uint8), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def save_samples_npz(path, images: np.ndarray, labels: np.ndarray) -> Path:
    """The ADM batch layout, written atomically: arr_0 uint8 [N, H, W, 3], arr_1 int64 [N]."""
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    return atomic_write(Path(path), lambda f: np.savez(f, arr_0=images, arr_1=labels))


@torch.no_grad()
def generate(net, seeds: Sequence[int], *, sampler_kwargs: Optional[Mapping] = None, decoder, batch_size: int = 64,
             num_classes: Optional[int] = None, device=None, accelerator=None, class_labels=None,
             progress: bool = True, latent_shape=None, gather: bool = True) -> Samples:
    """Sample one image per seed. Returns `Samples`: gathered, every row in the order of `seeds` on the main
    process and none on the others.

    gather=False: nothing is sent to the main process; every rank returns its own share, e.g. for
    `evaluations.distributed_features.compute_features_distributed` (a rank with no batch: n = 0).

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
    # the callers' values, checked where they were given (sample.py, training.config_check)
    num_classes = int(num_classes if num_classes is not None else net.num_classes)
    assert batch_size >= 1 and num_classes >= 1, (batch_size, num_classes)
    if class_labels is not None and np.ndim(class_labels) == 0:
        class_labels = int(class_labels)
    elif class_labels is not None:
        class_labels = [int(c) for c in class_labels]
        assert len(class_labels) == len(seeds), f"class_labels has {len(class_labels)} entries for {len(seeds)} seeds"
    fixed = [class_labels] if isinstance(class_labels, int) else class_labels or []
    assert all(0 <= c < num_classes for c in fixed), f"class labels must lie in 0..{num_classes - 1}"
    sampler = make_sampler(sampler_kwargs)
    shape = tuple(latent_shape) if latent_shape is not None else _latent_shape(net)

    starts = list(range(0, len(seeds), batch_size))
    rounds = math.ceil(len(starts) / world)
    all_images, all_labels = None, np.zeros(len(seeds), dtype=np.int64)
    own = []  # gather=False: this rank's (first row, images, labels)
    bar = SamplingProgress(len(seeds), count_network_evaluations(sampler_kwargs), enabled=progress and rank == 0)
    with _eval_mode(net):
        for r in range(rounds):
            item = None
            round_end = starts[(r + 1) * world] if (r + 1) * world < len(starts) else len(seeds)
            bar.start_round(starts[r * world], round_end - starts[r * world])
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
                x = sampler(bar.watch(net), latents, labels, randn_like=rnd.randn_like)
                # on a CPU an SD-VAE image takes seconds: decoded one by one there, so that the bar moves
                images = bar.decode(decoder, x.to(torch.float32), per_image=device.type == "cpu")
                item = (b, images.astype(np.uint8, copy=False), labels.cpu().numpy().astype(np.int64))
            if not gather:
                if item is not None:
                    own.append((starts[b], item[1], item[2]))
                bar.end_round(round_end)
                continue
            for got in gather_to_main(item, world, rank) or []:
                if got is None:
                    continue
                lo, images, labels = starts[got[0]], got[1], got[2]
                if all_images is None:  # filled in place: the main process holds the samples once
                    all_images = np.empty((len(seeds), *images.shape[1:]), dtype=np.uint8)
                all_images[lo:lo + len(images)] = images
                all_labels[lo:lo + len(labels)] = labels
            bar.end_round(round_end)
    bar.close()
    if gather:
        if rank != 0 or all_images is None:
            return _no_samples()
        return Samples(all_images, all_labels, np.arange(len(seeds), dtype=np.int64))
    if not own:
        return _no_samples()
    indices = np.concatenate([np.arange(lo, lo + len(labels)) for lo, _, labels in own])
    return Samples(np.concatenate([o[1] for o in own]), np.concatenate([o[2] for o in own]), indices)
