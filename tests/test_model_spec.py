"""model.params, declared once (tread_utils/model_spec.py): its fields are the keys the config check takes and
the arguments `dit.DiT` gets, their types and rules hold for Python callers too, and the names of `init` and
`block_type` are dit.py's registries, read when a rule runs."""
import dataclasses
import inspect
import subprocess
import sys
from typing import Optional

import pytest

import dit
from conftest import REPO, subprocess_env, tiny_overrides
from test_config_schema import compose_train
from training import config_schema as S
from training.config_check import check_train_config
from tread_utils import model_spec
from tread_utils.errors import UserError
from tread_utils.schema_fields import above, key

DATA = dict(num_classes=10, in_channels=1, input_size=16)


def field(name):
    return next(f for f in dataclasses.fields(model_spec.ModelParamsSchema) if f.name == name)


def test_the_schema_fields_are_the_arguments_of_dit():
    """Every argument of DiT is a model.params key and every key an argument, but for the authors' keys that
    name the one behaviour built (accepted with that value, never passed on); the config's node is this one."""
    arguments = set(inspect.signature(dit.DiT.__init__).parameters) - {"self"}
    keys = {f.name for f in dataclasses.fields(model_spec.ModelParamsSchema)}
    assert keys == arguments | set(model_spec.PAPER_ONLY_VALUES) and not arguments & set(model_spec.PAPER_ONLY_VALUES)
    assert S.ModelSchema.__dataclass_fields__["params"].type is model_spec.ModelParamsSchema


def test_a_field_added_to_the_schema_is_a_key_the_model_takes_with_its_type_and_rule(monkeypatch):
    """No list of keys or types beside the schema: a field added to it is accepted, typed and ruled as written
    there, and handed to DiT (`model_kwargs` is what get_model passes)."""
    extended = dataclasses.make_dataclass(
        "ModelParamsSchema", [("dropout", Optional[float], key("dropout rate", None, rule=above(0)))],
        bases=(model_spec.ModelParamsSchema,))
    monkeypatch.setattr(model_spec, "ModelParamsSchema", extended)
    assert dit.model_kwargs("DiT-T/2", {**DATA, "dropout": 1})["dropout"] == 1.0
    for value, needle in (("0.1", "model.params.dropout must be a number, got '0.1'"),
                          (0, "model.params.dropout must be > 0, got 0")):
        with pytest.raises(UserError, match=needle):
            dit.model_kwargs("DiT-T/2", {**DATA, "dropout": value})


def test_a_block_type_registered_from_outside_is_a_config_value_without_a_schema_edit(monkeypatch):
    rule = field("block_type").metadata["rule"]
    assert rule.reads_registry and not rule.ok("wide")
    monkeypatch.setitem(dit.BLOCK_TYPES, "wide", dit.DiTBlock)
    assert rule.ok("wide") and rule.allowed.endswith(", wide")  # documented with it
    merged = check_train_config(compose_train("model=dit", "model.params.block_type=wide")).config
    assert merged.model.params.block_type == "wide"
    with pytest.raises(UserError, match=r"model.params.block_type=narrow is not allowed: .*one of attention, ssm, .*wide"):
        check_train_config(compose_train("model.params.block_type=narrow"))
    model = dit.get_model("DiT-T/2", {**DATA, "block_type": "wide", "depth": 1})
    assert type(model.blocks[0]) is dit.DiTBlock


def test_python_callers_get_the_schema_rules_in_one_line():
    """get_model and from_pretrained check what the config check checks: the schema's rules, the registries'
    names, and the model's own rule (a patch grid that fits)."""
    for params, needle in (({"init": "xavier"}, "model.params.init must be one of official, adaln_zero"),
                           ({"block_type": "wide"}, "model.params.block_type must be null (model.backbone_type's) "
                                                    "or one of attention, ssm"),
                           ({"num_classes": 0}, "model.params.num_classes must be >= 1, got 0"),
                           ({"depth": True}, "model.params.depth must be an integer, got True"),
                           ({"input_size": 15}, "input_size 15 is not divisible by patch size 2")):
        with pytest.raises(UserError) as info:
            dit.get_model("DiT-T/2", {**DATA, **params})
        assert needle in str(info.value) and "\n" not in str(info.value)


COUNTED_LAUNCH = """
import atexit, runpy, sys
import routing_module
calls = []
resolve = routing_module.resolve_routes
def counted(routes, *args, **kwargs):  # the config's entries made into routes: resolved routes pass unchanged
    if any(not isinstance(r, routing_module.Route) for r in routes or []):
        calls.append(routes)
    return resolve(routes, *args, **kwargs)
routing_module.resolve_routes = counted
atexit.register(lambda: print(f"routes resolved {len(calls)} time(s)"))
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_launch_resolves_its_routes_once(tmp_path):
    """train.py turns the config's route entries into routes once, in its check: the model, its EMA and the FLOP
    report take those (the resolver, idempotent, gives resolved routes back as they are)."""
    overrides = [*tiny_overrides("tread"), f"results_dir={tmp_path}", "train.max_steps=1", "train.ckpt_every=1",
                 "train.general.num_workers=0", "train.cpu_threads=1", "train.general.batch_size=4"]
    proc = subprocess.run([sys.executable, "-c", COUNTED_LAUNCH, *overrides], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FLOPs per training step" in proc.stdout  # the report ran, on the model's resolved routes
    assert "routes resolved 1 time(s)" in proc.stdout


def test_the_one_resolver_is_idempotent():
    """Config entries become placed, checked routes; resolving those again gives them back equal, so code below the
    launch may pass them on without knowing whether they were resolved."""
    import dit
    from routing_module import resolve_routes

    entries = [{"start_layer_idx": 1, "end_layer_idx": -4, "selection_ratio": 0.5, "selection": "importance"},
               {"start_layer_idx": -3, "end_layer_idx": -2, "selection_ratio": 0.25, "fusion": "sprint"}]
    once = resolve_routes(entries, 12, dit.FUSIONS)
    assert [(r.start_layer_idx, r.end_layer_idx) for r in once] == [(1, 8), (9, 10)]
    assert once[0].options == {} and once[1].fusion_options == {}
    assert resolve_routes(once, 12, dit.FUSIONS) == once
