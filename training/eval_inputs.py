"""What the in-training FID needs from outside the run, found by the configuration check, before the run
folder exists: the VAE that decodes the latents (data.latent_vae), the Inception weights, and a reference
made by the network that will score. Offline (HF_HUB_OFFLINE=1, TREAD_OFFLINE=1) or without a connection,
a missing file is one line in a few seconds, naming the key that supplies it.

`train.eval.smoke=true` replaces the Inception weights by a seeded random network and accepts any sample
count from 2: the whole loop runs offline, and its numbers mean nothing.
"""
from tread_utils.errors import UserError
from tread_utils.hub import HUB_OFFLINE_ENVS, marked_offline, unreachable

SMOKE_MIN_SAMPLES = 2
SMOKE_WARNING = ("train.eval.smoke=true: the in-training FID uses a randomly initialised Inception network; "
                 "its numbers only show that the loop runs and mean nothing")


def scoring_tag(cfg) -> str:
    """The `feature_network` tag of the in-training scorer of a latent dataset."""
    from evaluations.reference_check import network_tag

    return network_tag("inception", bool(cfg.train.eval.smoke))


def check_inception_weights(weights):
    """The Inception weights file is here, or can be downloaded now; else one line naming the key."""
    from evaluations import inception_weights as I

    try:
        I.resolve_inception_weights(weights, allow_download=False)
        return
    except UserError:
        pass
    why = marked_offline((I.OFFLINE_ENV, *HUB_OFFLINE_ENVS))
    why = f"{why}=1" if why else unreachable(I.WEIGHTS_URL)
    if why:
        raise UserError(f"Inception weights are not here and cannot be downloaded ({why}): give pytorch-fid's "
                        f"{I.WEIGHTS_FILENAME} as train.eval.inception_weights=PATH (docs/sampling.md), or "
                        f"train.eval.smoke=true")


def check_eval_inputs(cfg):
    """The in-training FID's VAE, Inception weights and reference of a latent dataset (typed config)."""
    e = cfg.train.eval
    if e.eval_interval <= 0 or cfg.dataset.kind != "shards":
        return
    from data.latent_vae import decoding_vae
    from evaluations.reference_check import check_reference_network

    decoding_vae(cfg.dataset)
    if e.smoke and e.inception_weights:
        raise UserError(f"train.eval.inception_weights={e.inception_weights} is unused with train.eval.smoke=true "
                        f"(random weights); set train.eval.inception_weights=null, or train.eval.smoke=false")
    if not e.smoke:
        check_inception_weights(e.inception_weights)
    tag = scoring_tag(cfg)
    fix = ("give a reference made with `python fid.py ref --random-init`, or train.eval.smoke=false" if e.smoke
           else "set train.eval.smoke=true, or give a reference made with the real weights (ADM's, or `fid.py ref`)")
    check_reference_network(e.ref_batch, tag, fix)
