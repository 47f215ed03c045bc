"""diffusers versions: apply_tread refuses a version whose code differs in what routing reads (block lists,
forward parameters), naming it, and warns in one line on an untested version whose structure passes."""
import inspect
import warnings

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import build, one_per_family, shared_checks  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.families import FAMILIES  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]}


def test_the_tested_version_attaches_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tread(build("flux")[0], ROUTE)


@pytest.mark.parametrize("version", ["0.43.0.dev0", "0.36.0"])
def test_an_untested_version_that_passes_warns_in_one_line(monkeypatch, version):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", version)
    model, inputs, _ = build("sd3")
    with pytest.warns(UserWarning, match=f"diffusers {version} passes the structural check of "
                                         "SD3Transformer2DModel but is untested") as seen:
        handle = apply_tread(model, ROUTE)
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    model.train()
    model(**inputs)
    assert handle.last_keep[0].shape == (2, 8)


def test_a_block_list_that_changed_is_refused_naming_it():
    model, _, _ = build("flux")
    model.single_transformer_blocks = torch.nn.Sequential(*model.single_transformer_blocks)
    with pytest.raises(UserError, match="FluxTransformer2DModel.single_transformer_blocks is not a list") as err:
        apply_tread(model, ROUTE)
    assert "\n" not in str(err.value)


def test_a_block_signature_that_changed_is_refused_naming_it(monkeypatch):
    """FLUX's single-stream blocks before diffusers took text and image as one hidden_states, no
    encoder_hidden_states: such a block is refused, naming the missing parameter."""
    model, _, _ = build("flux")
    block = model.single_transformer_blocks[0]
    original = inspect.signature(type(block).forward)
    params = [p for name, p in original.parameters.items() if name != "encoder_hidden_states"]

    def forward(self, hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        return hidden_states
    forward.__signature__ = original.replace(parameters=params)
    monkeypatch.setattr(type(block), "forward", forward)
    with pytest.raises(UserError, match=r"single_transformer_blocks\[i\].forward has no parameter "
                                        "encoder_hidden_states, which apply_tread relies on") as err:
        apply_tread(model, ROUTE)
    assert "\n" not in str(err.value) and not model._forward_pre_hooks


def test_a_renamed_block_parameter_is_refused_naming_it(monkeypatch):
    model, _, _ = build("wan")
    monkeypatch.setattr(type(model.blocks[0]), "forward", lambda self, hidden_states, encoder_hidden_states, temb,
                        rope: hidden_states)
    with pytest.raises(UserError, match=r"WanTransformer3DModel.blocks\[i\].forward has no parameter rotary_emb"):
        apply_tread(model, ROUTE)


@pytest.mark.parametrize("name", one_per_family(shared_checks()))
def test_each_block_parameter_the_family_reads_is_checked(monkeypatch, name):
    """The tested version attaches silently; a block without a parameter its family relies on is refused naming it."""
    model, _, _ = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tread(model, ROUTE).remove()
    model_name = type(model).__name__
    for part, needed in FAMILIES[model_name].relies_on.items():
        if part == "forward":
            continue
        block_type = type(getattr(model, part)[0])
        original = inspect.signature(block_type.forward)
        for dropped in needed:
            def forward(self, *args, **kwargs):
                return args[0]
            forward.__signature__ = original.replace(parameters=[p for n, p in original.parameters.items()
                                                                 if n != dropped])
            monkeypatch.setattr(block_type, "forward", forward)
            with pytest.raises(UserError, match=rf"{model_name}.{part}\[i\].forward has no parameter {dropped},"):
                apply_tread(model, ROUTE)
            monkeypatch.undo()
