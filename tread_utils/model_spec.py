"""`model.params`, declared once: the config schema's node (training/config_schema.py) and the arguments
`dit.DiT` takes (dit.py checks a Python caller's, and an exported config.json's, against the same fields).

A key added here is a config key, documented in docs/configuration.md, and passed to `DiT`; its type and its
rule hold for the config and for Python callers alike. The names `init` and `block_type` take are read from
dit.py's registries (`INITS`, `BLOCK_TYPES`) when a rule runs, so a block type registered there needs no edit
here. Torch-free, like the rest of the schema: a bad config is refused before torch is imported.
"""
from dataclasses import dataclass
from typing import List, Optional

from tread_utils.route_spec import Route
from tread_utils.schema_fields import at_least, key, or_null, registry


@dataclass
class ModelParamsSchema:
    num_classes: int = key("number of classes (the null class is added): the dataset's", rule=at_least(1))
    in_channels: int = key("latent channels: the dataset's", rule=at_least(1))
    input_size: int = key("latent height = width: the dataset's", rule=at_least(1))
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
    block_type: Optional[str] = key("the blocks, a key of dit.BLOCK_TYPES", None, rule=or_null(
        registry("dit:BLOCK_TYPES"), "model.backbone_type's"), eg="attention")
    init: str = key("weight initialisation (official: the authors' xavier; adaln_zero: DiT's)",
                    rule=registry("dit:INITS"), eg="official")
    cond_mode: str = key("conditioning: adaln (the only one)")
    learn_sigma: bool = key("predict the variance too (not supported: false)")


# Keys of the authors' model config that name the only behaviour built here: accepted with that value alone
# (they are no arguments of `DiT`).
PAPER_ONLY_VALUES = {"cond_mode": ("adaln", "adaLN conditioning is the only one built"),
                     "learn_sigma": (False, "EDM's denoiser predicts no variance")}
