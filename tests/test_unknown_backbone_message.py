"""A backbone name not in the registry is refused in a line short enough to read: the closest name, then each family
with its sizes and patches, under 200 characters whatever the typo."""
import re

import pytest

from dit import DiT_models, get_model
from tread_utils.errors import UserError

DATA = dict(num_classes=10, in_channels=1, input_size=16)


def refusal(name) -> str:
    with pytest.raises(UserError) as e:
        get_model(name, DATA)
    return str(e.value)


def test_a_missing_slash_gets_the_name_meant():
    message = refusal("DiT-B2")
    assert "did you mean DiT-B/2?" in message and len(message) < 200, message
    assert "DiT-{D,T,S,B,L,XL}/{2,4,8}" in message and "model.backbone_type" in message


@pytest.mark.parametrize("name", sorted(DiT_models))
def test_every_registry_name_mistyped_is_offered_back_in_under_200_characters(name):
    for typo in (name.replace("/", ""), name.lower()):
        message = refusal(typo)
        assert f"did you mean {name}?" in message and len(message) < 200, message


def test_the_families_cover_the_registry_and_nothing_else():
    """Every name the families spell out is in the registry, and every registry name is spelled out."""
    families = refusal("no-such-model").split("families: ")[1]
    spelled = {f"{family}-{size}/{patch}"
               for family, sizes, patches in re.findall(r"(\w+)-\{([\w,]+)\}/\{([\d,]+)\}", families)
               for size in sizes.split(",") for patch in patches.split(",")}
    assert spelled == set(DiT_models)
    assert "did you mean" not in refusal("no-such-model")
