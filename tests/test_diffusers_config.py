"""SimpleTuner's tread_config as its users write it (a dict, the list, or the command line's string) and the kept
count conventions (the authors' N - int(N * r), SimpleTuner's N - round(N * r))."""
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import build  # noqa: E402
from routing_module import RouteError, num_kept, resolve_routes  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.tread import routes_from_config  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

CLI = '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}'  # --tread_config '...'
AS_DICT = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}


def test_the_command_line_string_routes_as_the_dict_does():
    kept = {}
    for config in (CLI, " " + CLI.replace('"', "'"), AS_DICT, AS_DICT["routes"]):
        model, inputs, _ = build("sd3")
        handle = apply_tread(model, config)
        model.train()
        torch.manual_seed(1)
        kept[repr(config)] = (handle.routes, handle.last_keep, model(**inputs)[0])
    (routes, _, out), *others = kept.values()
    assert (routes[0].start_layer_idx, routes[0].end_layer_idx, routes[0].selection_ratio) == (1, 2, 0.5)
    for other_routes, _, other_out in others:
        assert other_routes == routes and torch.equal(other_out, out)


@pytest.mark.parametrize("value, match", [
    ('{"routes": [{"selection_ratio": false, "start_layer_idx": 1, "end_layer_idx": 2}]}', "not a Python literal"),
    ('{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]', "never closed"),
    ("{'routes': [{'selection_ratio': __import__('os'), 'start_layer_idx': 1, 'end_layer_idx': 2}]}",
     "not a Python literal"),
    ('{"routes": [{"selection_ratio": False, "start_layer_idx": 1, "end_layer_idx": 2}]}', "must be a number"),
    ('{"routes": [{"selection_ratio": "0.5", "start_layer_idx": 1, "end_layer_idx": 2}]}', "must be a number"),
    ('{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2.5, "end_layer_idx": 3}]}', "must be an integer"),
    ('{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": True}]}', "must be an integer"),
    ("routes: 0.5 1 2", "as a list of mappings"),
])
def test_bad_config_strings_are_refused_in_one_line(value, match):
    model, _, _ = build("sd3")
    with pytest.raises(UserError, match=match) as err:
        apply_tread(model, value)
    assert "\n" not in str(err.value) and not model._forward_pre_hooks


ROUTE_TEXT = '{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2'


@pytest.mark.parametrize("json_word, config", [("true", '{"routes": [' + ROUTE_TEXT + '}], "verbose": true}'),
                                               ("null", '{"routes": [' + ROUTE_TEXT + ', "importance_mix": null}]}'),
                                               ("false", '{"routes": [' + ROUTE_TEXT + '}], "verbose": false}')])
def test_json_words_in_a_config_string_are_refused(json_word, config):
    """JSON's true/false/null where SimpleTuner's --tread_config reads a Python literal: refused, never read as
    True/False/None (each word sits where the Python value is accepted: a route's importance_mix, a key beside the
    routes that apply_tread does not read; a parser that rewrote it would pass the config silently)."""
    python_value = {"true": "True", "false": "False", "null": "None"}[json_word]
    routes_from_config(config.replace(json_word, python_value), 4)  # the Python spelling is a valid route
    with pytest.raises(RouteError, match="not a Python literal") as err:
        routes_from_config(config, 4)
    assert "\n" not in str(err.value) and "True/False/None" in str(err.value)


@pytest.mark.parametrize("key, value, match", [("selection_ratio", False, "must be a number"),
                                               ("selection_ratio", "0.5", "must be a number"),
                                               ("start_layer_idx", 2.5, "must be an integer"),
                                               ("end_layer_idx", True, "must be an integer")])
def test_model_params_routes_refuse_the_same_values(key, value, match):
    route = dict(AS_DICT["routes"][0], **{key: value})
    with pytest.raises(RouteError, match=match):
        resolve_routes([route], 4)
    with pytest.raises(RouteError, match=match):
        apply_tread(build("sd3")[0], [route])


def test_kept_count_conventions():
    """Over 60 (N, ratio) pairs the two conventions differ by one token in some; each keeps what it says."""
    model, _, _ = build("sd3")
    authors = apply_tread(model, AS_DICT)
    authors.remove()
    simpletuner = apply_tread(model, AS_DICT, kept_count="simpletuner")
    differ = 0
    for n in (16, 64, 77, 256, 1024, 4096):
        for ratio in (0.1, 0.25, 0.3, 0.35, 0.5, 0.55, 0.6, 0.7, 0.75, 0.9):
            assert num_kept(n, authors._ratio(ratio, n)) == n - int(n * ratio)
            assert num_kept(n, simpletuner._ratio(ratio, n)) == n - round(n * ratio)
            differ += int(n * ratio) != round(n * ratio)
    assert differ > 0
    assert num_kept(4, simpletuner._ratio(0.9, 4)) == 1  # round(3.6) would skip all four: one is kept
    with pytest.raises(UserError, match="choose one of authors, simpletuner"):
        apply_tread(build("sd3")[0], AS_DICT, kept_count="ceil")


def test_simpletuner_kept_count_in_a_routed_forward():
    """SD3's 16 tokens at ratio 0.3: the authors keep 16 - 4 = 12, SimpleTuner 16 - round(4.8) = 11."""
    for kept_count, kept in (("authors", 12), ("simpletuner", 11)):
        model, inputs, _ = build("sd3")
        handle = apply_tread(model, {"routes": [{"selection_ratio": 0.3, "start_layer_idx": 0, "end_layer_idx": 1}]},
                             kept_count=kept_count)
        model.train()
        model(**inputs)
        assert handle.last_keep[0].shape[1] == kept


def test_the_readme_config_string_routes_as_it_is():
    import ast
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## TREAD on diffusers models"):]
    (literal,) = re.findall(r"^tread_config = ('[^\n]*')  #", section, re.M)
    model, inputs, _ = build("flux", single_layers=4)  # 6 blocks: the route 2 -> -2 is blocks 2..4
    handle = apply_tread(model, ast.literal_eval(literal))
    assert (handle.routes[0].start_layer_idx, handle.routes[0].end_layer_idx) == (2, 4)
    model.train()
    model(**inputs)
    assert handle.last_keep[0].shape == (2, 12)
