"""TREAD on pretrained diffusers transformers (docs/diffusers.md): `apply_tread(transformer, routes)` routes their
image tokens by module hooks. A package beside the model code, for the users who fine-tune those models: DiT, the
training loop and the entry points never import it (`tools/import_layers.py` checks it), so they load none of it.

    from tread_diffusers import apply_tread, compile_blocks, masked_loss, shard_blocks

`tread` attaches the routes (`apply_tread`, its `TreadHandle`, `routes_from_config`); `families` says what routing
needs to know of a transformer family (its `Family`), and `flux_families`, `image_families`, `video_families` and
`sequence_families` register the families; `masks` reads force-keep masks (`read_mask`, `mask_to_tokens`,
`masked_loss`); `compile` compiles block by block (`compile_blocks`); `fsdp` shards block by block with FSDP2
(`shard_blocks`)."""
from tread_diffusers.compile import compile_blocks
from tread_diffusers.fsdp import shard_blocks
from tread_diffusers.masks import mask_to_tokens, masked_loss, read_mask
from tread_diffusers.tread import TreadHandle, apply_tread, routes_from_config

__all__ = ["apply_tread", "TreadHandle", "routes_from_config", "compile_blocks", "masked_loss", "mask_to_tokens",
           "read_mask", "shard_blocks"]
