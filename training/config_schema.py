"""The typed schema of every config key: configs/config.yaml with its groups (model, diffuser, dataset;
sweep presets only set hydra.* and keys named here) and configs/sample.yaml. One place that says what each
key is (its `doc`, from which docs/configuration.md is written by `python -m tools.config_doc`).

The schema is the base the YAML files extend: importing this module stores it in Hydra's ConfigStore
(`base_config`, `base_sample`, and the group bases `model/base_model`, `diffuser/base_diffuser`), and the
YAML defaults lists name them, so composition itself refuses an unknown key or a wrong type and fills the
defaults here (a route's, for one). The YAML files stay the defaults users read: a key the YAML always sets
has no default here (MISSING), a key it may leave out has its default here (None = "decided elsewhere",
see its text). A key's value rule sits with its field (`rule`: checked by `training.config_check`, shown in
the reference); `training.config_check` adds the rules that span keys. The words fields are written in (`key`,
`Rule`) are tread_utils/schema_fields.py's; `model.params` is tread_utils/model_spec.py's, which the model
layer reads too.

Light on purpose (dataclasses, omegaconf and Hydra's ConfigStore): a bad config is refused before torch
is imported.
"""
from dataclasses import dataclass, make_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore

from tread_utils.model_spec import ModelParamsSchema
from tread_utils.schema_fields import UNIT, Rule, above, at_least, each, key, one_of, or_null, registry


# dataset.kind -> feature dimension of the in-training FID scorer (digits classifier, Inception pool_3):
# the covariance of fewer samples than this is singular and the FID meaningless.
SCORER_FEATURE_DIMS = {"digits": 128, "shards": 2048}
SHARDS_ONLY = ("train_path", "scale_factor", "random_flip", "posterior_sampling", "quantize", "vae")  # dataset keys
# [sigma_lo, sigma_hi] of a guidance interval, training's (train.eval) and sample.py's
GUIDANCE_INTERVAL = Rule(lambda v: v is None or (len(v) == 2 and 0 <= v[0] <= v[1]),
                         "null or [sigma_lo, sigma_hi] with 0 <= sigma_lo <= sigma_hi")


@dataclass
class ModelSchema:
    name: str = key("dit or tread: names the run")
    backbone_type: str = key("a key of dit.DiT_models, e.g. DiT-B/2 (default: the dataset's)")
    params: ModelParamsSchema = key("the backbone's arguments", factory=ModelParamsSchema)


@dataclass
class DiffuserSchema:
    name: str = key("the diffusion formulation (rf: rectified flow)", rule=registry("training.checkpoint:DIFFUSERS"), eg="edm")
    P_mean: float = key("mean of log sigma (edm) or of the logit of t (rf) during training")
    P_std: float = key("its standard deviation", rule=above(0), eg=1.2)
    sigma_data: float = key("data standard deviation (unused by rf)", rule=above(0), eg=0.5)


@dataclass
class DatasetSchema:
    name: str = key("names the run")
    kind: str = key("the data (digits: embedded, shards: precomputed latents)", rule=registry("data:DATASETS"), eg="digits")
    in_channels: int = key("latent channels")
    input_size: int = key("latent height = width")
    num_classes: int = key("number of classes")
    backbone_type: str = key("the backbone that suits it (model.backbone_type's default)")
    train_path: Optional[str] = key("shards (required): folder of .tar shards or .latents.npy/.labels.npy pairs", None)
    scale_factor: Optional[float] = key("shards: latent scale (null: from the manifest, or measured)", None)
    random_flip: bool = key("shards: a random horizontal flip per read (stored flip pairs or the latent)", False)
    posterior_sampling: bool = key("shards: draw from stored posterior moments (false: their mean)", False)
    quantize: str = key("shards: decoded images to uint8 (truncate: the authors')", "truncate",
                        rule=registry("data.vae:QUANTIZE"), eg="truncate")
    vae: Optional[str] = key("shards: SD-VAE folder or repo id for decoding (null: stabilityai/sd-vae-ft-ema)", None)


# sampler key -> (type, meaning); every key may be null: the sampler's own default. The values are checked by
# generation.make_sampler, the function that builds the sampler.
SAMPLER_KEYS = {
    "name": (str, "a name in generation.SAMPLERS: edm (Heun), heun, euler, ablation, flow (null: edm)"),
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
    batch_size: int = key("global batch, divisible by processes x grad_accum_steps", rule=at_least(1), eg=256)
    class_drop_prob: float = key("label -> null class, for classifier-free guidance", rule=UNIT, eg=0.1)
    num_workers: int = key("data loader workers per process", rule=at_least(0), eg=4)
    grad_accum_steps: int = key("micro-batches per optimizer step", rule=at_least(1), eg=1)


@dataclass
class OptimizerSchema:
    lr: float = key("AdamW learning rate", rule=above(0), eg=1e-4)
    betas: List[float] = key("AdamW betas", rule=Rule(lambda v: len(v) == 2 and all(UNIT.ok(b) for b in v),
                                                      "two values in [0, 1)"), eg="[0.9,0.999]")
    eps: float = key("AdamW epsilon", rule=above(0), eg=1e-8)
    weight_decay: float = key("AdamW weight decay", rule=at_least(0), eg=0)
    grad_clip: Optional[float] = key("max gradient norm", rule=or_null(above(0), "no clipping"), eg=1.0)
    warmup_steps: int = key("linear learning-rate warm-up over this many steps (0: none, the authors')",
                            rule=at_least(0), eg=0)


@dataclass
class EMASchema:
    decay: float = key("EMA of the weights, updated every step (1 would never move it)", rule=UNIT, eg=0.9999)


@dataclass
class WandbSchema:
    enabled: bool = key("log to wandb (if installed)")
    project: str = key("wandb project")
    id: Optional[str] = key("wandb run id to resume (null: new)")


@dataclass
class LoggingSchema:
    log_interval: int = key("steps between log records", rule=at_least(1), eg=100)
    tensorboard: bool = key("TensorBoard event files")
    wandb: WandbSchema = key("wandb", factory=WandbSchema)


@dataclass
class EvalSchema:
    eval_interval: int = key("in-training FID every this many steps and at the end (0: off)", rule=at_least(0),
                             eg=50000)
    fid_num_samples: int = key("samples per FID, at least the scorer's feature dimension")
    batch_size: int = key("sampling batch per process", rule=at_least(1), eg=64)
    seed: int = key("images use seeds seed .. seed + fid_num_samples - 1", rule=at_least(0), eg=100000)
    sampler: SamplerSchema = key("the sampler (as sample.py's sampler)", factory=SamplerSchema)
    all_metrics: bool = key("also IS, sFID, precision, recall")
    ref_batch: Optional[str] = key("latents: ADM reference batch .npz (required when evaluating)")
    inception_weights: Optional[str] = key("Inception weights file (null: $TREAD_INCEPTION_WEIGHTS / cache)")
    cfg_scales: List[Optional[float]] = key(
        "guidance scales to evaluate (1 or null: unguided)", rule=Rule(
            lambda v: len(v) >= 1 and all(s is None or s >= 0 for s in v), "a non-empty list of scales >= 0 or null"),
        eg="[null,1.5]")
    path_drop_scales: List[float] = key("SPRINT path-drop guidance scales to evaluate (sprint routes)",
                                        rule=each(at_least(0), empty="none"), eg="[1.5]")
    guidance_interval: Optional[List[float]] = key("guidance only inside this noise interval (null: everywhere)",
                                                   None, rule=GUIDANCE_INTERVAL, eg="[0.3,2.9]")
    fp32: bool = key("evaluate in fp32 whatever train.mixed_precision")
    smoke: bool = key("offline smoke test: random-init Inception (no weights), fid_num_samples from 2; the numbers "
                      "mean nothing", False)


@dataclass
class KeepCheckpointsSchema:
    newest: Optional[int] = key("keep the newest this many checkpoints (the newest is the one a resume reads)", None,
                                rule=or_null(at_least(1), "keep all, the authors'"), eg=2)
    every: Optional[int] = key("with newest: also keep those at steps that are multiples of this", None,
                               rule=or_null(at_least(1), "none"), eg=100000)


@dataclass
class TrainSchema:
    max_steps: int = key("the run stops here", rule=at_least(1), eg=400000)
    ckpt_every: int = key("checkpoint interval (also at the end and on SIGTERM/SIGINT)", rule=at_least(1), eg=50000)
    mixed_precision: str = key("accelerate's mixed precision", rule=one_of("no", "bf16", "fp16"), eg="bf16")
    compile: bool = key("torch.compile the backbone")
    compile_scope: str = key("what train.compile compiles: model (the whole forward, one graph) or blocks (each "
                             "block and the final layer alone, as the authors' code compiles, the block loop "
                             "and routing eager: a few small graphs, shared by every block, that compile faster)", rule=registry("training.compile:SCOPES"),
                             eg="blocks")
    compile_dynamic: Optional[bool] = key("compiled shapes: null (torch's default: static, dynamic once a shape "
                                          "changes), true (dynamic from the start), false (static: one graph per "
                                          "shape)", None)
    tf32: bool = key("TF32 matmuls/convolutions on CUDA")
    keep_cudnn_attention: bool = key("keep cuDNN's fused attention on a torch / cuDNN / GPU where its backward was "
                                     "seen to fault (false: flash or memory-efficient attention, said in one line)")
    attention: str = key("the attention kernels of the model's blocks (tread_utils/attention.py; what each runs and on "
                         "which GPU: docs/performance.md), its package and GPU checked at start-up",
                         rule=registry("tread_utils.attention:BACKENDS"), eg="flash4")
    attention_fp32: str = key("the kernel of float32 attention (the block after a route under mixed precision): "
                              "sdpa (torch's own choice; on a GPU its memory-efficient kernel in float32, as the "
                              "authors' code) or math (two batched matmuls and a softmax: TF32 on CUDA under "
                              "train.tf32, the [B, H, N, N] scores held in memory)",
                              rule=registry("tread_utils.attention:FLOAT32"), eg="math")
    cpu_threads: Any = key("CPU runs: torch threads per process, or auto (cores / local processes)", rule=Rule(
        lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        "auto or an integer >= 1"), eg="auto")
    dist_timeout_minutes: int = key("timeout of collective operations between processes, in minutes",
                                    rule=at_least(1), eg=60)
    distributed: str = key("how several processes share the model: ddp (a full replica on each, gradients "
                           "all-reduced) or fsdp2 (model, EMA and optimizer state sharded per DiT block, training/"
                           "fsdp.py; checkpoints as ddp's)", rule=one_of("ddp", "fsdp2"), eg="fsdp2")
    routing_off_after: Optional[int] = key("routing off from this training step on", None,
                                           rule=or_null(at_least(0), "never"), eg=350000)
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
    block: int = key("the aligned block, 0-based: its output tokens, below the model's depth (REPA's encoder_depth "
                     "d: d-1)", rule=at_least(0), eg=3)
    weight: float = key("weight of the alignment term (REPA: 0.5)", rule=at_least(0), eg=0.5)
    encoder: str = key("the frozen teacher (digits_classifier: dataset.kind=digits only)",
                       rule=registry("training.repa_teachers:TEACHERS"), eg="dinov2_vitb14")
    encoder_weights: Optional[str] = key("dinov2_vitb14: weights file or folder (null: the Hugging Face cache); "
                                         "digits_classifier: a weights file (null: the shipped one)")
    projector_dim: int = key("hidden width of REPA's 3-layer MLP projector (REPA: 2048)", rule=at_least(1), eg=2048)


@dataclass
class ConfigSchema:
    """configs/config.yaml after composition (what train.py receives)."""
    imports: List[str] = key("modules of your own, imported before the config is checked (they register selection "
                             "rules, fusions, blocks; tread_utils/user_imports.py): module names, e.g. [my_rules], "
                             "found in the working directory or on PYTHONPATH; saved with the run, imported again by "
                             "sample.py and the route probe", factory=list)
    results_dir: str = key("runs live in results_dir/run_name")
    run_name: str = key("the run directory's name (a sweep job: run_name/<its overrides>)")
    global_seed: int = key("weights, data order and per-rank noise", rule=at_least(0), eg=0)
    init_from: Optional[str] = key("new run from another run's weights (checkpoint file or run dir)")
    init_from_optimizer: bool = key("with init_from: also take its optimizer state")
    init_from_weights: str = key("with init_from: what to take (model_and_ema: its model and EMA; ema: its EMA as "
                                 "both, as SPRINT's _ft configs)", rule=one_of("model_and_ema", "ema"), eg="model_and_ema")
    resume: bool = key("continue the newest checkpoint of run_name; false moves the old run aside")
    lock_stale_minutes: float = key("a run lock from another host not refreshed for this many minutes is stale",
                                    rule=above(0), eg=60)
    model: ModelSchema = key("the model group", factory=ModelSchema)
    diffuser: DiffuserSchema = key("the diffuser group", factory=DiffuserSchema)
    dataset: DatasetSchema = key("the dataset group", factory=DatasetSchema)
    train: TrainSchema = key("training", factory=TrainSchema)
    repa: RepaSchema = key("REPA representation alignment", factory=RepaSchema)


@dataclass
class RoutingGuidanceSchema:
    scale: Optional[float] = key("routing guidance scale (null: off)")
    weak_ratio: float = key("fraction of tokens that skip the routes in the weak pass", rule=UNIT, eg=0.7)
    strong_ratio: float = key("... in the strong pass", rule=UNIT, eg=0.3)


@dataclass
class PathDropGuidanceSchema:
    scale: Optional[float] = key("SPRINT path-drop guidance scale (null: off)", None)


@dataclass
class SampleSchema:
    """configs/sample.yaml (what sample.py receives)."""
    ckpt: str = key("checkpoint file or run directory")
    out: str = key("output .npz")
    num_samples: Optional[int] = key("number of images", rule=or_null(at_least(1), "one image per seed"), eg=500)
    seeds: Any = key("e.g. 0-49999, [0,5,7] or '0-9,20-29' (a list in brackets or quotes: Hydra refuses a bare "
                     "0,5,7); default: 0..num_samples-1")
    batch_size: int = key("images per batch, per process", rule=at_least(1), eg=64)
    class_labels: Optional[int] = key("a class index for every image, below the model's num_classes",
                                      rule=or_null(at_least(0), "a random class per seed"), eg=3)
    grid: Optional[str] = key("a PNG grid: one row per class (more than 10 classes: the first grid_images)")
    grid_images: int = key("images in a plain grid (models with more than 10 classes)", rule=at_least(1), eg=64)
    grid_per_class: int = key("samples per class row of the grid", rule=at_least(1), eg=8)
    vae: Optional[str] = key("SD-VAE folder or repo id for latents")
    progress: bool = key("progress bar on the main process")
    tf32: bool = key("TF32 on CUDA")
    sampler: SamplerSchema = key("the sampler", factory=SamplerSchema)
    cfg_scale: float = key("classifier-free guidance scale (1: unguided)")
    guidance_interval: Optional[List[float]] = key("CFG only inside this noise interval (null: everywhere)",
                                                   rule=GUIDANCE_INTERVAL, eg="[0.3,5]")
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
