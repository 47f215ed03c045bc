"""The value rules of a config, every one of them, run once by the entry point before anything runs: no
directory created, no checkpoint touched. The schema (`training.config_schema`) is the configs' base, so
composition has already refused a wrong type or an unknown key (`hydra_error_line` words Hydra's error);
this pass merges the resolved config into the schema once more (a key added with `+` and a value an
interpolation gave are typed there), then applies each key's rule (its schema field's `rule`) and the
rules that span keys. The model's
own rules (backbone, `model.params`, routes) are `dit.model_kwargs` and `routing_module.resolve_routes`,
the checks Python callers of `dit.get_model` get too: this pass calls them last, so a bad value elsewhere
is refused before torch is loaded. Each refusal is one UserError line naming the key, the value, what is
allowed and a fix; code below the entry point asserts what it relies on instead of checking again.
"""
import dataclasses
import functools
import os
import re
import typing
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from training import config_schema as S
from tread_utils.errors import UserError
from tread_utils.schema_fields import TYPE_WORDS, scalar_type


def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def list_element(tp):
    """X for List[X] / Optional[List[X]], else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return args[0] if args else None
    return list_element(args[0]) if typing.get_origin(tp) is typing.Union and len(args) == 1 else None


def schema_keys(cls, prefix: str = "") -> list:
    """Every leaf key of a schema, `a.b.c`; a list of schemas as `routes[i].field`."""
    out = []
    for name, tp in _field_types(cls).items():
        element = list_element(tp)
        if dataclasses.is_dataclass(tp):
            out += schema_keys(tp, f"{prefix}{name}.")
        elif element is not None and dataclasses.is_dataclass(element):
            out += schema_keys(element, f"{prefix}{name}[i].")
        else:
            out.append(prefix + name)
    return out


def schema_at(cls, path: str):
    """The schema class at a dotted path (list indices allowed), or None."""
    for part in [p for p in path.split(".") if p]:
        if part.isdigit():
            continue
        tp = _field_types(cls).get(part) if dataclasses.is_dataclass(cls) else None
        cls = list_element(tp) or tp if tp is not None else None
    return cls if dataclasses.is_dataclass(cls) else None


def unknown_key(root, full_key: str) -> UserError:
    full_key = dotted(full_key)
    parent, _, name = full_key.rpartition(".")
    cls = schema_at(root, parent)
    known = ", ".join(f.name for f in dataclasses.fields(cls)) if cls else "none"
    hint = getattr(cls, "UNKNOWN_KEY_HINT", "").format(parent=parent, key=name)
    return UserError(f"unknown config key {full_key}; {parent or 'the top level'} has: {known}{hint}")


def dotted(full_key: str) -> str:
    """OmegaConf's `routes[0].foo` as the command line spells it, `routes.0.foo`."""
    return re.sub(r"\[(\d+)\]", r".\1", full_key)


def _doc(root, full_key: str) -> str:
    parent, _, name = dotted(full_key).rpartition(".")
    cls = schema_at(root, parent)
    found = [f for f in dataclasses.fields(cls) if f.name == name] if cls else []
    return f" ({found[0].metadata['doc']})" if found else ""


def group_given_a_value(cls, key: str, value) -> UserError:
    names = [f.name for f in dataclasses.fields(cls)]
    return UserError(f"{key}={value}: {key} is a group of settings ({', '.join(names)}); set them one by one, "
                     f"e.g. {key}.{names[0]}={value}")


def check_override_types(overrides, root=None):
    """Hydra's composition converts a command-line 2 into true for a flag: each `key=value` of the command line,
    as typed there, against its key's type (a flag takes true or false, a count an integer, a number no bool)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    root = root or S.ConfigSchema
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_delete() or override.is_sweep_override():
            continue
        parent, _, name = override.key_or_group.rpartition(".")
        cls = schema_at(root, parent)
        tp = _field_types(cls).get(name) if cls else None
        value = override.value()
        if tp is not None and not exact_type(tp, value):
            raise UserError(f"{override.input_line} must be {TYPE_WORDS[scalar_type(tp)]}"
                            f"{_doc(root, override.key_or_group)}")


def exact_type(tp, value) -> bool:
    """A flag must be a bool, a count an integer, a number never a bool (a string: OmegaConf's own check)."""
    kind = scalar_type(tp)
    if kind is None or value is None or isinstance(value, str):
        return True
    if kind is bool:
        return isinstance(value, bool)
    return not isinstance(value, bool) and (kind is float or float(value).is_integer())


def _walk_lists(cls, data, path: str, root):
    """OmegaConf loses the path of an error inside a list element: check schema lists element by element."""
    if not isinstance(data, dict):
        return
    for name, tp in _field_types(cls).items():
        value, element = data.get(name), list_element(tp)
        if dataclasses.is_dataclass(tp):
            if value is not None and not isinstance(value, dict):  # e.g. sampler=euler for sampler.name=euler
                raise group_given_a_value(tp, f"{path}{name}", value)
            _walk_lists(tp, value, f"{path}{name}.", root)
        elif element is not None and dataclasses.is_dataclass(element) and isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise UserError(f"{path}{name}.{i}={item!r} must be a mapping of {element.__name__} keys")
                conform(element, item, f"{path}{name}.{i}.", root)


@functools.lru_cache(maxsize=None)
def _structured(cls):
    """The schema as a config, built once (half the cost of a check); merge copies it, never changes it."""
    return OmegaConf.structured(cls)


def conform(cls, data: dict, path: str = "", root=None):
    """`data` (plain, resolved) merged into the schema `cls`: unknown keys and wrong types are refused."""
    root = root or cls
    _walk_lists(cls, data, path, root)
    try:
        return OmegaConf.merge(_structured(cls), data)
    except ConfigKeyError as e:
        raise unknown_key(root, path + str(e.full_key)) from None
    except OmegaConfBaseException as e:
        full_key = path + str(getattr(e, "full_key", "") or "")
        value = OmegaConf.select(OmegaConf.create(data), full_key[len(path):]) if full_key != path else None
        reason = str(getattr(e, "msg", e)).splitlines()[0]
        raise UserError(f"{full_key}={value!r}: {reason}{_doc(root, full_key)}") from None


def refuse(key: str, value, allowed: str, fix: str = "") -> UserError:
    return UserError(f"{key}={value} is not allowed: it must be {allowed}" + (f"; {fix}" if fix else ""))


def ruled_keys(cls, prefix: str = ""):
    """(key, field) of every schema field with a rule, depth first."""
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(f.type):
            yield from ruled_keys(f.type, key + ".")
        elif f.metadata.get("rule") is not None:
            yield key, f


def check_rules(cfg, cls):
    """Every key's own rule, from its schema field (`rule`, `eg`), depth first; the rules that read a registry
    come last because reading one imports torch, so any other bad value is refused without it."""
    fields = sorted(ruled_keys(cls), key=lambda kf: kf[1].metadata["rule"].reads_registry)
    for key, f in fields:
        rule, value = f.metadata["rule"], OmegaConf.select(cfg, key)
        if not rule.ok(value):
            example = f.metadata["eg"]
            raise refuse(key, value, rule.allowed, f"e.g. {key}={'...' if example is None else example}")


def check_sampler(cfg, prefix: str):
    """A sampler node (train.eval.sampler, sample.py's sampler), built by the function that builds it for
    sampling (generation.make_sampler, which checks its name, settings and values): null means its default."""
    from generation import make_sampler  # torch: only for a config whose own values passed

    try:
        make_sampler(OmegaConf.to_container(OmegaConf.select(cfg, prefix)))
    except UserError as e:
        raise UserError(f"{prefix}: {e}") from None


def check_guidance_has_dropout(key: str, scales, class_drop_prob):
    """Classifier-free guidance (`scales`: a scale or a list; 1 and null are unguided) of a model trained with
    `class_drop_prob` (train.general.class_drop_prob; null: not recorded)."""
    unguided = "[null]" if isinstance(scales, list) else "1"
    if class_drop_prob == 0 and any(s not in (None, 1) for s in (scales if isinstance(scales, list) else [scales])):
        raise refuse(key, scales, f"{unguided} for a model trained with train.general.class_drop_prob=0 (without class "
                     f"dropout it has no unconditional mode)", f"e.g. {key}={unguided}")


def check_paths(cfg):
    """Files the run reads, checked before the model is built."""
    d = cfg.dataset
    if d.kind == "shards":
        if not d.train_path:
            raise UserError("dataset.train_path is required for dataset.kind=shards: set "
                            "dataset.train_path=/path/to/shards (python -m data.extract_latents writes them)")
    optional = ("init_from", "train.eval.ref_batch", "train.eval.inception_weights", "repa.encoder_weights")
    for key in ("dataset.train_path",) * (d.kind == "shards") + optional:
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().exists():
            raise UserError(f"{key}={value} does not exist; give an existing path"
                            + (f", or {key}=null" if key in optional else ""))
    shards = Path(d.train_path or ".").expanduser()
    if d.kind == "shards" and not os.access(shards, os.R_OK | (os.X_OK if shards.is_dir() else 0)):
        raise UserError(f"dataset.train_path={d.train_path} is not readable; check its permissions")
    e = cfg.train.eval
    if e.eval_interval > 0 and d.kind == "shards" and not e.ref_batch:
        raise UserError("train.eval.ref_batch=null: in-training FID on latents needs a reference batch; set "
                        "train.eval.ref_batch=VIRTUAL_imagenet256_labeled.npz (ADM's), or train.eval.eval_interval=0")
    check_init_from_resumes(cfg)
    check_init_from_source(cfg)


def check_init_from_source(cfg):
    """init_from's source read before the run folder exists (its header and config; the weights load later):
    readable, a model of this config's sizes, and holding an optimizer state if init_from_optimizer asks."""
    if not cfg.init_from:
        return
    from training.checkpoint import check_same_model, load_checkpoint, resolve_checkpoint

    source = resolve_checkpoint(cfg.init_from)
    state = load_checkpoint(source, header_only=True)
    if "config" not in state:
        raise UserError(f"init_from={cfg.init_from}: {source} holds no config (not a checkpoint of this project)")
    check_same_model(state["config"]["model"], OmegaConf.to_container(cfg.model, resolve=True), source)
    if cfg.init_from_optimizer and "optimizer" not in state:
        raise UserError(f"init_from={cfg.init_from} holds no optimizer state (an exported model holds the EMA weights "
                        f"only); set init_from_optimizer=false, or give the run directory")


def check_init_from_resumes(cfg):
    """init_from with a run folder that already holds checkpoints: the run resumes from them, so init_from is
    honoured only if that run was itself started from the same source (a fine-tune resumed by its own command)."""
    if not cfg.init_from or not cfg.resume:
        return
    from training.checkpoint import list_checkpoints  # torch: only for a run that starts from another's weights

    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    if not list_checkpoints(run_dir / "checkpoints"):
        return
    saved = run_dir / "config.yaml"
    started_from = OmegaConf.load(saved).get("init_from") if saved.is_file() else None
    if started_from is None or Path(str(started_from)).expanduser().resolve() != \
            Path(str(cfg.init_from)).expanduser().resolve():
        raise UserError(f"init_from={cfg.init_from} would be ignored: {run_dir} already holds checkpoints of a run "
                        f"started {f'from {started_from}' if started_from else 'from scratch'}, and it would resume "
                        f"from them; give the fine-tune its own run_name=..., or resume=false to start this one over")


def check_cross(cfg, world_size: int):
    g, e = cfg.train.general, cfg.train.eval
    per_step = world_size * g.grad_accum_steps
    if g.batch_size % per_step:
        raise refuse("train.general.batch_size", g.batch_size,
                     f"divisible by processes x train.general.grad_accum_steps = {world_size} x "
                     f"{g.grad_accum_steps} = {per_step}", f"e.g. train.general.batch_size={per_step * max(1, g.batch_size // per_step)}")
    dims = 2 if e.smoke else S.SCORER_FEATURE_DIMS[cfg.dataset.kind]  # smoke: warned at run time instead
    if e.eval_interval > 0 and e.fid_num_samples < dims:
        raise refuse("train.eval.fid_num_samples", e.fid_num_samples,
                     f"at least {dims}, the {cfg.dataset.kind} FID scorer's feature dimension (fewer: a "
                     f"singular covariance)", f"e.g. train.eval.fid_num_samples={max(dims, 2 * dims)}, or "
                     f"train.eval.eval_interval=0 (train.eval.smoke=true: a smoke run from 2 samples)")
    if e.eval_interval > 0:
        check_guidance_has_dropout("train.eval.cfg_scales", list(e.cfg_scales), g.class_drop_prob)
    keep = cfg.train.keep_checkpoints
    if keep.every is not None and keep.newest is None:
        raise refuse("train.keep_checkpoints.every", keep.every, "null while train.keep_checkpoints.newest=null "
                     "(every checkpoint is kept)", "e.g. train.keep_checkpoints.newest=2")
    if cfg.model.params.num_classes != cfg.dataset.num_classes:
        raise refuse("model.params.num_classes", cfg.model.params.num_classes,
                     f"dataset.num_classes={cfg.dataset.num_classes}", "remove the override")
    check_distributed(cfg, world_size)


def check_distributed(cfg, world_size: int):
    """train.distributed=fsdp2 shards the DiT over several processes; what it does not shard is refused."""
    if cfg.train.distributed != "fsdp2":
        return
    ddp = "or train.distributed=ddp"
    refused = [(world_size < 2, "a single process", f"launch several (accelerate launch --multi_gpu --num_processes "
                                                    f"N) {ddp}"),
               (cfg.repa.enabled, "repa.enabled=true", f"its projector is not sharded: repa.enabled=false {ddp}"),
               (cfg.train.compile, "train.compile=true", f"train.compile=false {ddp}"),
               (cfg.train.mixed_precision == "fp16", "train.mixed_precision=fp16",
                f"there is no sharded grad scaler: train.mixed_precision=bf16 {ddp}")]
    for found, what, fix in refused:
        if found:
            raise UserError(f"train.distributed=fsdp2 is not allowed with {what}; {fix}")


def resolved(cfg) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise UserError(f"configuration: {str(e).splitlines()[0]} (set it on the command line, e.g. key=value)") \
            from None


def refuse_missing(merged, schema):
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        key = missing[0]
        raise UserError(f"{key} is required{_doc(schema, key)}: set {key}=... on the command line")


class CheckedTrainConfig(NamedTuple):
    config: Any       # the config merged into the schema (types converted, defaults filled)
    model_args: dict  # the model's checked arguments, routes resolved: the run builds its model from them


def check_train_config(cfg, world_size: int = 1, overrides=()) -> CheckedTrainConfig:
    """The whole training config, and the command line's `overrides` as typed. The routes resolve here, once
    per launch: the training loop builds the model from the returned `model_args`."""
    check_override_types(overrides)
    data = resolved(cfg)
    merged = conform(S.ConfigSchema, data)
    refuse_missing(merged, S.ConfigSchema)
    check_rules(merged, S.ConfigSchema)
    if merged.dataset.kind != "shards":
        defaults = OmegaConf.structured(S.DatasetSchema)
        for name in S.SHARDS_ONLY:
            if merged.dataset[name] != defaults[name]:
                raise refuse(f"dataset.{name}", merged.dataset[name], f"left at its default {defaults[name]} (it "
                             f"applies to dataset.kind=shards only, this is {merged.dataset.kind})", "remove the override")
    check_sampler(merged, "train.eval.sampler")
    check_cross(merged, world_size)
    check_paths(merged)
    import dit  # the model code (torch) only now: backbone, model.params and routes, as get_model checks them

    model_args = dit.model_kwargs(data["model"]["backbone_type"], data["model"]["params"])
    e = merged.train.eval
    if e.eval_interval > 0 and e.path_drop_scales and not any(map(dit.drops_deep_path, model_args["routes"])):
        raise refuse("train.eval.path_drop_scales", list(e.path_drop_scales), "[] for a model with no route whose "
                     "fusion can drop its deep path", "e.g. model.params.routes.0.fusion=sprint, or "
                     "train.eval.path_drop_scales=[]")
    check_repa(merged, model_args["depth"])
    from training.eval_inputs import check_eval_inputs

    check_eval_inputs(merged)  # the VAE, Inception weights and reference: found, not loaded
    return CheckedTrainConfig(merged, model_args)


def check_repa(cfg, depth: int):
    """REPA's rules that need the model's depth or the dataset, and its teacher weights (found, not loaded)."""
    r = cfg.repa
    if not r.enabled:
        return
    if r.block >= depth:
        raise refuse("repa.block", r.block, f"in 0..{depth - 1} (the model has {depth} blocks)",
                     f"e.g. repa.block={depth // 3}")
    if r.encoder == "digits_classifier" and cfg.dataset.kind != "digits":
        raise refuse("repa.encoder", r.encoder, "used with dataset.kind=digits only (it reads 16 x 16 grey digits)",
                     "e.g. repa.encoder=dinov2_vitb14")
    if r.encoder == "dinov2_vitb14":
        from training.repa_teachers import dinov2_weights_file

        dinov2_weights_file(r.encoder_weights)


def check_sample_config(cfg):
    """sample.py's options (configs/sample.yaml); its command checks the rest (seeds, paths, checkpoint)."""
    merged = conform(S.SampleSchema, resolved(cfg))
    refuse_missing(merged, S.SampleSchema)
    check_rules(merged, S.SampleSchema)
    check_sampler(merged, "sampler")
    return merged


def hydra_error_line(e, schema=S.ConfigSchema) -> str:
    """One line for an error Hydra raises while composing (a bad override, an unknown group option, a value
    of the wrong type for the schema, a group of settings given one value)."""
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    full_key = dotted(str(getattr(cause, "full_key", None) or ""))
    override = re.search(r"override '?([\w.]+)", str(e))
    if full_key and override and not (full_key.startswith(override[1]) or override[1].startswith(full_key)):  # inside a list given whole: its key
        full_key = f"{override[1]}.{full_key}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and full_key:
        return str(unknown_key(schema, full_key))
    group = schema_at(schema, full_key) if full_key else None
    if group is not None and str(e).startswith("Error merging override"):  # a group given a value: sampler=euler
        return str(group_given_a_value(group, full_key, str(e).partition("=")[2]))
    if isinstance(cause, ValidationError) and full_key:
        reason = str(getattr(cause, "msg", cause)).splitlines()[0]
        return f"{full_key}: {reason}{_doc(schema, full_key)}"
    text = str(e).split("Config search path")[0]
    return "configuration: " + " ".join(line.strip() for line in text.splitlines() if line.strip())
