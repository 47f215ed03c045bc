"""Regional compilation of a diffusers transformer routed by TREAD: `compile_blocks(transformer)`.

Each block's `forward` is compiled on its own; the module hooks that route tokens (tread_diffusers/tread.py)
stay eager around it. Blocks of one class share their graphs (torch.compile takes their parameters as inputs),
so a FLUX compiles a few graphs whatever its depth: per block class, one for the full sequence and one for the
kept tokens (the ratio is fixed, so the shapes are). The model-level forward (embedders, the loop) stays eager.

    transformer.enable_gradient_checkpointing()   # if at all: before compile_blocks
    handle = apply_tread(transformer, routes)
    compile_blocks(transformer)          # after apply_tread and any LoRA adapters; options go to torch.compile

Gradient checkpointing goes inside the graphs: with it on when compile_blocks runs, each block's compiled
forward holds its own non-reentrant checkpoint, so the recomputation runs in the compiled backward (torch.compile
partitions the checkpointed region) instead of a second eager call through the hooks, with a Python pack and
unpack hook per saved tensor. The host's work per block and step goes from three compiled calls to two; the
activations kept are the same (the block's inputs). The transformer's `_gradient_checkpointing_func` then only
marks the call; a module that is not a compiled block (a family's refiner, say) is checkpointed as before.
Checkpointing switched on after compile_blocks still works, checkpointed outside the compiled blocks.

diffusers' `transformer.compile_repeated_blocks()` works with the routes too (tested): it compiles each block
with its hooks, so the routing is traced into the graphs, which then come in more variants (the route's first
block, its inner blocks, its last one) and take longer to compile.
"""
import contextvars
import functools
import types

import torch
from torch.utils.checkpoint import checkpoint

from tread_diffusers.families import family_blocks

_CHECKPOINTING = contextvars.ContextVar("tread_compiled_checkpoint", default=False)


def compile_blocks(transformer, **options) -> int:
    """torch.compile every block's forward (keywords go to torch.compile), gradient checkpointing inside it where
    the transformer has it on; returns the number of blocks. A block compiled already is left as it is, so a
    second call changes nothing."""
    blocks = family_blocks(transformer)
    checkpointed = {}  # forward function -> it under a checkpoint (one code object, so one graph cache, each)
    for block in blocks:
        if getattr(block.forward, "_tread_compiled", False) or hasattr(block.forward, "_torchdynamo_orig_callable"):
            continue
        forward = block.forward
        plain = torch.compile(forward, **options)
        if getattr(forward, "__self__", None) is block:  # a method of the block, not a library's wrapper around it
            if forward.__func__ not in checkpointed:
                checkpointed[forward.__func__] = _under_checkpoint(type(block), forward.__func__)
            inner = checkpointed[forward.__func__]
            block.forward = _dispatching(forward, plain, torch.compile(types.MethodType(inner, block), **options))
        else:
            block.forward = plain
    if getattr(transformer, "gradient_checkpointing", False):
        func = getattr(transformer, "_gradient_checkpointing_func", None)
        func = getattr(func, "_tread_original", func)  # under the routing's replay wrapper (tread.py), if any
        if func is not None and not getattr(func, "_tread_in_graph", False):
            transformer._gradient_checkpointing_func = _checkpoint_in_graph(func)
    return len(blocks)


def _under_checkpoint(cls, forward):
    """`forward(self, ...)` of `cls` run under a non-reentrant checkpoint, as a function with a code object of
    its own named for the class: torch.compile keeps its graphs and its recompile limit per code object, so each
    block class gets a cache of its own, as its own forward does."""
    def run(self, *args, **kwargs):
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    code = run.__code__.replace(co_name=f"{cls.__name__}_checkpointed",
                                co_qualname=f"{cls.__name__}.forward_checkpointed")
    return types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__)


def _dispatching(original, plain, checkpointed):
    """A block's forward: the compiled checkpointed one inside `_checkpoint_in_graph`, else the compiled plain one;
    with the original's signature (what apply_tread reads)."""
    @functools.wraps(original)
    def forward(*args, **kwargs):
        return (checkpointed if _CHECKPOINTING.get() else plain)(*args, **kwargs)
    forward._tread_compiled = True
    return forward


def _checkpoint_in_graph(original):
    """The transformer's `_gradient_checkpointing_func(block, *args)`: a compiled block checkpoints itself in its
    graph, so it is only called, marked; anything else goes to the original function. A wrapper (the routing's
    replay, tread.py) names the block it calls as its `__wrapped__`."""
    def run(block, *args, **kwargs):
        target = getattr(block, "__wrapped__", block)
        if not getattr(getattr(target, "forward", None), "_tread_compiled", False):
            return original(block, *args, **kwargs)
        token = _CHECKPOINTING.set(True)
        try:
            return block(*args, **kwargs)
        finally:
            _CHECKPOINTING.reset(token)
    run._tread_in_graph = True
    return run
