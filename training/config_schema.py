"""The typed schema of every config key: configs/config.yaml with its groups (model, diffuser, dataset;
sweep presets only set hydra.* and keys named here) and configs/sample.yaml. One place that says what each
key is (its `doc`, from which docs/configuration.md is written by `python -m tools.config_doc`).

The schema is the base the YAML files extend: importing this module stores it in Hydra's ConfigStore
(`base_config`, `base_sample`, and the group bases `model/base_model`, `diffuser/base_diffuser`), and the
YAML defaults lists name them, so composition itself refuses an unknown key or a wrong type and fills the
defaults here (a route's, for one). The YAML files stay the defaults users read: a key the YAML always sets
has no default here (MISSING), a key it may leave out has its default here (None = "decided elsewhere",
see its text). `training.config_check` then applies the value and cross-field rules.

Light on purpose (dataclasses, omegaconf and Hydra's ConfigStore): a bad config is refused before torch
is imported.
"""
from dataclasses import dataclass, field, make_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from route_spec import Route


def key(doc: str, default=MISSING, factory=None):
    """A schema field with its documentation; `factory` builds a mutable default (a list)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


# Names the config may choose from, defined by code that imports torch; tests/test_config_schema.py checks
# each against its registry, so the two cannot drift apart.
DIFFUSER_NAMES = ("edm", "rf")                       # training.checkpoint.DIFFUSERS
DATASET_KINDS = ("digits", "shards")                 # data.DATASETS
SAMPLER_NAMES = ("ablation", "edm", "euler", "flow", "heun")  # generation.SAMPLERS
# dataset.kind -> feature dimension of the in-training FID scorer (digits classifier, Inception pool_3):
# the covariance of fewer samples than this is singular and the FID meaningless.
SCORER_FEATURE_DIMS = {"digits": 128, "shards": 2048}
MIXED_PRECISION = ("no", "bf16", "fp16")
SHARDS_ONLY = ("train_path", "scale_factor", "random_flip", "posterior_sampling", "quantize", "vae")  # dataset keys
QUANTIZE = ("truncate", "round")                     # data.vae.QUANTIZE
INIT_FROM_WEIGHTS = ("model_and_ema", "ema")  # training.loop.init_weights
REPA_ENCODERS = ("dinov2_vitb14", "digits_classifier")  # training.repa_teachers.TEACHERS


@dataclass
class ModelParamsSchema:
    num_classes: int = key("number of classes (the null class is added)")
    in_channels: int = key("latent channels")
    input_size: int = key("latent height = width")
    enable_routing: bool = key("routing during training")
    routes: List[Route] = key("routes, in order, without overlap")
    depth: Optional[int] = key("override the backbone's number of blocks (null: the registry's)", None)
    hidden_size: Optional[int] = key("override the backbone's width", None)
    num_heads: Optional[int] = key("override the backbone's attention heads", None)
    mlp_ratio: Optional[float] = key("override the MLP width ratio (4)", None)
    patch_size: Optional[int] = key("override the patch size", None)
    qk_norm: Optional[bool] = key("normalise queries and keys (false)", None)
    fp32_after_route: Optional[bool] = key("route bookkeeping in fp32 under mixed precision (true)", None)
    grad_checkpointing: Optional[bool] = key("recompute block activations in the backward pass (false)", None)
    block_type: Optional[str] = key("attention or ssm (the registry's)", None)
    init: str = key("weight initialisation: official (the authors' xavier) or adaln_zero (DiT's)")
    cond_mode: str = key("conditioning: adaln (the only one)")
    learn_sigma: bool = key("predict the variance too (not supported: false)")


@dataclass
class ModelSchema:
    name: str = key("dit or tread: names the run")
    backbone_type: str = key("a key of dit.DiT_models, e.g. DiT-B/2 (default: the dataset's)")
    params: ModelParamsSchema = key("the backbone's arguments", factory=ModelParamsSchema)


@dataclass
class DiffuserSchema:
    name: str = key("edm or rf (rectified flow)")
    P_mean: float = key("mean of log sigma (edm) or of the logit of t (rf) during training")
    P_std: float = key("its standard deviation, > 0")
    sigma_data: float = key("data standard deviation, > 0 (unused by rf)")


@dataclass
class DatasetSchema:
    name: str = key("names the run")
    kind: str = key("digits (embedded) or shards (precomputed latents)")
    in_channels: int = key("latent channels")
    input_size: int = key("latent height = width")
    num_classes: int = key("number of classes")
    backbone_type: str = key("the backbone that suits it (model.backbone_type's default)")
    train_path: Optional[str] = key("shards (required): folder of .tar shards or .latents.npy/.labels.npy pairs", None)
    scale_factor: Optional[float] = key("shards: latent scale (null: from the manifest, or measured)", None)
    random_flip: bool = key("shards: a random horizontal flip per read (stored flip pairs or the latent)", False)
    posterior_sampling: bool = key("shards: draw from stored posterior moments (false: their mean)", False)
    quantize: str = key("shards: decoded images to uint8, truncate (the authors') or round", "truncate")
    vae: Optional[str] = key("shards: SD-VAE folder or repo id for decoding (null: stabilityai/sd-vae-ft-ema)", None)


# sampler key -> (type, meaning); every key may be null: the sampler's own default
SAMPLER_KEYS = {
    "name": (str, "edm (Heun) | heun | euler | ablation | flow (null: edm)"),
    "num_steps": (int, "sampling steps, >= 1 (null: 40)"),
    "sigma_min": (float, "lowest noise level, < sigma_max"),
    "sigma_max": (float, "highest noise level"),
    "rho": (float, "time-step exponent"),
    "S_churn": (float, "stochasticity (0: deterministic ODE)"),
    "S_min": (float, "churn only above this sigma"),
    "S_max": (float, "churn only below this sigma"),
    "S_noise": (float, "churn noise scale"),
    "solver": (str, "ablation and flow: heun | euler"),
    "discretization": (str, "ablation: edm | vp | ve | iddpm"),
    "schedule": (str, "ablation: linear | vp | ve"),
    "scaling": (str, "ablation: none | vp"),
    "alpha": (float, "ablation: Heun's intermediate point"),
    "epsilon_s": (float, "ablation (vp)"),
    "C_1": (float, "ablation (iddpm)"),
    "C_2": (float, "ablation (iddpm)"),
    "M": (int, "ablation (iddpm)"),
}
SamplerSchema = make_dataclass("SamplerSchema", [(name, Optional[tp], key(doc, None))
                                                 for name, (tp, doc) in SAMPLER_KEYS.items()])


@dataclass
class GeneralSchema:
    batch_size: int = key("global batch, divisible by processes x grad_accum_steps")
    class_drop_prob: float = key("label -> null class, for classifier-free guidance, in [0, 1)")
    num_workers: int = key("data loader workers per process, >= 0")
    grad_accum_steps: int = key("micro-batches per optimizer step, >= 1")


@dataclass
class OptimizerSchema:
    lr: float = key("AdamW learning rate, > 0")
    betas: List[float] = key("AdamW betas, each in [0, 1)")
    eps: float = key("AdamW epsilon, > 0")
    weight_decay: float = key("AdamW weight decay, >= 0")
    grad_clip: Optional[float] = key("max gradient norm, > 0 (null: none)")
    warmup_steps: int = key("linear learning-rate warm-up over this many steps, >= 0 (0: none, the authors')")


@dataclass
class EMASchema:
    decay: float = key("EMA of the weights, updated every step, in [0, 1)")


@dataclass
class WandbSchema:
    enabled: bool = key("log to wandb (if installed)")
    project: str = key("wandb project")
    id: Optional[str] = key("wandb run id to resume (null: new)")


@dataclass
class LoggingSchema:
    log_interval: int = key("steps between log records, >= 1")
    tensorboard: bool = key("TensorBoard event files")
    wandb: WandbSchema = key("wandb", factory=WandbSchema)


@dataclass
class EvalSchema:
    eval_interval: int = key("in-training FID every this many steps and at the end (0: off)")
    fid_num_samples: int = key("samples per FID, at least the scorer's feature dimension")
    batch_size: int = key("sampling batch per process, >= 1")
    seed: int = key("images use seeds seed .. seed + fid_num_samples - 1")
    sampler: SamplerSchema = key("the sampler (as sample.py's sampler)", factory=SamplerSchema)
    all_metrics: bool = key("also IS, sFID, precision, recall")
    ref_batch: Optional[str] = key("latents: ADM reference batch .npz (required when evaluating)")
    inception_weights: Optional[str] = key("Inception weights file (null: $TREAD_INCEPTION_WEIGHTS / cache)")
    cfg_scales: List[Optional[float]] = key("guidance scales to evaluate, each >= 0 (1 or null: unguided)")
    path_drop_scales: List[float] = key("SPRINT path-drop guidance scales to evaluate, each >= 0 (sprint routes)")
    guidance_interval: Optional[List[float]] = key("[sigma_lo, sigma_hi]: guidance only inside (null: everywhere)",
                                                   None)
    fp32: bool = key("evaluate in fp32 whatever train.mixed_precision")
    smoke: bool = key("offline smoke test: random-init Inception (no weights), fid_num_samples from 2; the numbers "
                      "mean nothing", False)


@dataclass
class KeepCheckpointsSchema:
    newest: Optional[int] = key("keep the newest this many checkpoints, >= 1 (null: keep all, the authors')", None)
    every: Optional[int] = key("with newest: also keep those at steps that are multiples of this, >= 1 (null: none)",
                               None)


@dataclass
class TrainSchema:
    max_steps: int = key("the run stops here, >= 1")
    ckpt_every: int = key("checkpoint interval, >= 1 (also at the end and on SIGTERM/SIGINT)")
    mixed_precision: str = key("no | bf16 | fp16 (accelerate)")
    compile: bool = key("torch.compile the backbone")
    compile_dynamic: Optional[bool] = key("compiled shapes: null (torch's default: static, dynamic once a shape "
                                          "changes), true (dynamic from the start), false (static: one graph per "
                                          "shape)", None)
    tf32: bool = key("TF32 matmuls/convolutions on CUDA")
    cpu_threads: Any = key("CPU runs: torch threads per process, >= 1, or auto (cores / local processes)")
    dist_timeout_minutes: int = key("timeout of collective operations between processes, > 0")
    routing_off_after: Optional[int] = key("routing off from this training step on, >= 0 (null: never)", None)
    keep_checkpoints: KeepCheckpointsSchema = key("which checkpoints stay on disk (the newest always does)",
                                                  factory=KeepCheckpointsSchema)
    general: GeneralSchema = key("batch and data", factory=GeneralSchema)
    optimizer: OptimizerSchema = key("AdamW", factory=OptimizerSchema)
    ema: EMASchema = key("EMA", factory=EMASchema)
    logging: LoggingSchema = key("logging", factory=LoggingSchema)
    eval: EvalSchema = key("in-training evaluation", factory=EvalSchema)


@dataclass
class RepaSchema:
    enabled: bool = key("REPA's alignment loss (off by default: the authors' code has none)")
    block: int = key("the aligned block, 0-based: its output tokens, in 0..depth-1 (REPA's encoder_depth d: d-1)")
    weight: float = key("weight of the alignment term, >= 0 (REPA: 0.5)")
    encoder: str = key("the frozen teacher: dinov2_vitb14 or digits_classifier (digits only)")
    encoder_weights: Optional[str] = key("dinov2_vitb14: weights file or folder (null: the Hugging Face cache); "
                                         "digits_classifier: a weights file (null: the shipped one)")
    projector_dim: int = key("hidden width of REPA's 3-layer MLP projector, >= 1 (REPA: 2048)")


@dataclass
class ConfigSchema:
    """configs/config.yaml after composition (what train.py receives)."""
    results_dir: str = key("runs live in results_dir/run_name")
    run_name: str = key("the run directory's name (a sweep job: run_name/<its overrides>)")
    global_seed: int = key("weights, data order and per-rank noise")
    init_from: Optional[str] = key("new run from another run's weights (checkpoint file or run dir)")
    init_from_optimizer: bool = key("with init_from: also take its optimizer state")
    init_from_weights: str = key("with init_from: model_and_ema (its model and EMA) or ema (its EMA as both, "
                                 "as SPRINT's _ft configs)")
    resume: bool = key("continue the newest checkpoint of run_name; false moves the old run aside")
    lock_stale_minutes: float = key("a run lock from another host not refreshed for this long is stale, > 0")
    model: ModelSchema = key("the model group", factory=ModelSchema)
    diffuser: DiffuserSchema = key("the diffuser group", factory=DiffuserSchema)
    dataset: DatasetSchema = key("the dataset group", factory=DatasetSchema)
    train: TrainSchema = key("training", factory=TrainSchema)
    repa: RepaSchema = key("REPA representation alignment", factory=RepaSchema)


@dataclass
class RoutingGuidanceSchema:
    scale: Optional[float] = key("routing guidance scale (null: off)")
    weak_ratio: float = key("fraction of tokens that skip the routes in the weak pass")
    strong_ratio: float = key("... in the strong pass")


@dataclass
class PathDropGuidanceSchema:
    scale: Optional[float] = key("SPRINT path-drop guidance scale (null: off)", None)


@dataclass
class SampleSchema:
    """configs/sample.yaml (what sample.py receives)."""
    ckpt: str = key("checkpoint file or run directory")
    out: str = key("output .npz")
    num_samples: Optional[int] = key("number of images (default: the number of seeds)")
    seeds: Any = key("e.g. 0-49999, [0,5,7] or '0-9,20-29' (a list in brackets or quotes: Hydra refuses a bare "
                     "0,5,7); default: 0..num_samples-1")
    batch_size: int = key("per process, >= 1")
    class_labels: Optional[int] = key("null: a random class per seed; an integer: that class for all")
    grid: Optional[str] = key("a PNG grid: one row per class (more than 10 classes: the first grid_images)")
    grid_images: int = key("images in a plain grid (models with more than 10 classes), >= 1")
    grid_per_class: int = key("samples per class row of the grid, >= 1")
    vae: Optional[str] = key("SD-VAE folder or repo id for latents")
    progress: bool = key("progress bar on the main process")
    tf32: bool = key("TF32 on CUDA")
    sampler: SamplerSchema = key("the sampler", factory=SamplerSchema)
    cfg_scale: float = key("classifier-free guidance scale (1: unguided)")
    guidance_interval: Optional[List[float]] = key("[sigma_lo, sigma_hi]: CFG only inside (null: everywhere)")
    routing_guidance: RoutingGuidanceSchema = key("TREAD routing guidance", factory=RoutingGuidanceSchema)
    path_drop_guidance: PathDropGuidanceSchema = key("SPRINT path-drop guidance (sprint routes)",
                                                     factory=PathDropGuidanceSchema)


def register():
    """The schema as Hydra's base configs (the names the YAML defaults lists give)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=ConfigSchema)
    store.store(name="base_sample", node=SampleSchema)
    store.store(group="model", name="base_model", node=ModelSchema)
    store.store(group="diffuser", name="base_diffuser", node=DiffuserSchema)


register()
