"""A model whose class count is not the dataset's is refused before anything runs: a model with fewer classes than
the data would index out of its embedding table, one with more would sample classes the data never had."""
import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg
from training.config_check import check_train_config
from tread_utils.errors import UserError


def check(*overrides):
    cfg = compose_cfg(["model=tread", *overrides])
    return check_train_config(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), world_size=1)


@pytest.mark.parametrize("classes", [5, 11])
def test_a_model_class_count_other_than_the_datasets_is_refused(classes):
    with pytest.raises(UserError, match=rf"model\.params\.num_classes={classes} is not allowed: it must be "
                                        r"dataset\.num_classes=10"):
        check(f"model.params.num_classes={classes}")


def test_the_datasets_class_count_is_accepted():
    assert check("model.params.num_classes=10").config.model.params.num_classes == 10
