"""How `train.compile` compiles the backbone (`train.compile_scope`), and what dynamo has done since, as each log
record reports it (`CompileStats`).

Scopes:

* `model`: `torch.compile(model)`, one graph of the whole forward, the block loop and the routing's gather and
  scatter traced into it;
* `blocks`: every block and the final layer compiled on their own, in place (`module.compile()`, as the authors'
  `@torch.compile` on those forwards): the block loop, the routing and the embedders run eagerly. Dynamo
  inlines a block's module, so its parameters are graph inputs and every block of a type shares one graph per
  input shape: a routed model compiles three for its blocks (the full sequence, the routed one, the float32
  block after the route under mixed precision) and one for the final layer, whatever its depth, where `model`
  traces every block into one large graph.

Both take `train.compile_dynamic` as torch.compile's `dynamic`. Per block, torch's default (null) makes a routed
model's graphs dynamic: the first blocks' graph is static (the full sequence, in the patch embedder's transposed
layout), the routed sequence is a second shape, so dynamo traces it with a symbolic length and strides, and that
graph then serves the blocks after the route as well; the float32 block's graph is dynamic too. `dit` sees one
shape and layout and stays static, as does the whole-model graph. `false` keeps every graph static, one per shape
and layout (four block graphs for one route). A block's graphs count against dynamo's recompile limit (8 per
function, shared by all blocks of a type): a route whose kept count changes with a ratio schedule adds one per
count while shapes are static.
"""
import dataclasses
from typing import Optional

import torch

def compile_blocks(model: torch.nn.Module, **options) -> torch.nn.Module:
    # the final layer too, as the authors' code compiles it: compiled, its backward recomputes the normalised
    # tokens instead of keeping them (one float32 [B, N, D] tensor less at the peak)
    for module in (*model.blocks, model.final_layer):
        module.compile(**options)
    return model


# train.compile_scope -> how: what the denoiser calls, the compiled model (`model`) or `model` itself with each of
# its blocks compiled in place (`blocks`; the state dict keeps its keys); the config's rule reads the names here
SCOPES = {"model": torch.compile, "blocks": compile_blocks}


def compile_backbone(model: torch.nn.Module, scope: str = "model", **options) -> torch.nn.Module:
    """`model` compiled in `scope` (a name of SCOPES); `options`: torch.compile's (dynamic, backend, mode)."""
    return SCOPES[scope](model, **options)


def dynamo_counters():
    """torch.compile's counters, imported only by a compiled run: dynamo takes two seconds to import."""
    from torch._dynamo.utils import counters

    return counters


@dataclasses.dataclass
class CompileStats:
    """A compiled run's graphs and recompiles, counted from when it compiled its backbone (a later run of a sweep in
    the same process counts the graphs it added): `compiled_graphs`, dynamo's distinct graphs, and
    `recompiles_after_first_step`, the frames it compiled after this launch's first step (a shape or guard that
    changed mid-run, each a stall of seconds). A frame is one compilation of a function, the whole model's or a
    block's, in either scope."""
    graphs_before: int
    frames_at_first_step: Optional[int] = None

    @classmethod
    def start(cls) -> "CompileStats":
        return cls(int(dynamo_counters()["stats"]["unique_graphs"]))

    def step_done(self):
        """Called after every step; the first one's count is the reference of later recompiles."""
        if self.frames_at_first_step is None:
            self.frames_at_first_step = int(dynamo_counters()["frames"]["total"])

    def metrics(self) -> dict:
        if self.frames_at_first_step is None:
            return {}
        counters = dynamo_counters()
        return {"compiled_graphs": int(counters["stats"]["unique_graphs"]) - self.graphs_before,
                "recompiles_after_first_step": int(counters["frames"]["total"]) - self.frames_at_first_step}
