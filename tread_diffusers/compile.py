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

CUDA graphs: `mode="reduce-overhead"` (or "max-autotune") makes torch.compile capture each block's graphs,
forward and backward, with CUDA graph trees, which removes the host's launches from a step. With the checkpoint
inside the graphs the recomputation is captured too (a module compiled so *inside* a non-reentrant checkpoint
fails at replay instead). `CompiledSteps` runs the training steps of a model so compiled: each step begins a new
generation of graphs, and a step whose graphs fail is said in one line, then run again on blocks compiled
without CUDA graphs:

    steps = CompiledSteps(transformer, dynamic=False, mode="reduce-overhead")   # compiles the blocks
    for batch in batches:
        steps(lambda: train_step(batch))   # zero_grad, forward, backward, optimizer step

`dynamic=False` fits a route of fixed ratio: the kept count, so every shape, is the same at every step. On a CPU
inductor compiles such a mode without CUDA graphs (the steps are marked all the same).

diffusers' `transformer.compile_repeated_blocks()` works with the routes too (tested): it compiles each block
with its hooks, so the routing is traced into the graphs, which then come in more variants (the route's first
block, its inner blocks, its last one) and take longer to compile.
"""
import contextvars
import functools
import sys
import types

import torch
from torch.utils.checkpoint import checkpoint

from tread_diffusers.families import family_blocks

_CHECKPOINTING = contextvars.ContextVar("tread_compiled_checkpoint", default=False)
# torch.compile's modes that capture CUDA graphs, each with its mode without them
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# What CUDA graph trees raise when a graph's replay would not match its recording (torch's own words): a module
# compiled so inside a non-reentrant checkpoint fails this way
CAPTURE_FAILURE = "graph recording observed an input tensor deallocate"


def compile_blocks(transformer, **options) -> int:
    """torch.compile every block's forward (keywords go to torch.compile), gradient checkpointing inside it where
    the transformer has it on; returns the number of blocks. A block compiled already is left as it is, so a
    second call changes nothing."""
    blocks = family_blocks(transformer)
    _compile_forwards(blocks, options)
    if getattr(transformer, "gradient_checkpointing", False):
        func = getattr(transformer, "_gradient_checkpointing_func", None)
        func = getattr(func, "_tread_original", func)  # under the routing's replay wrapper (tread.py), if any
        if func is not None and not getattr(func, "_tread_in_graph", False):
            transformer._gradient_checkpointing_func = _checkpoint_in_graph(func)
    return len(blocks)


def _compile_forwards(blocks, options: dict) -> None:
    """Each block's forward compiled, a checkpointed twin beside it where the forward is the block's method; a
    block compiled already is left as it is. The forward it replaces is kept (`_tread_eager`)."""
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
        block.forward._tread_eager = forward


def _restore_forwards(blocks) -> None:
    """Each block compiled by `_compile_forwards` gets the forward it had back."""
    for block in blocks:
        forward = getattr(block.forward, "_tread_eager", None)
        if forward is None:
            continue
        if getattr(forward, "__self__", None) is block and forward.__func__ is getattr(type(block), "forward", None):
            del block.forward  # the class's method, as before
        else:
            block.forward = forward


class CompiledSteps:
    """Runs training steps of `transformer` with its blocks compiled by `compile_blocks(transformer, **options)`
    (done here). In a mode that captures CUDA graphs (CUDA_GRAPH_MODES), each step begins a new generation of
    graph trees (`torch.compiler.cudagraph_mark_step_begin`, before its forward: the blocks' graphs of one step
    form one path of the tree, and the previous step's outputs may be overwritten); a step whose graphs fail to
    replay (CAPTURE_FAILURE) is said in one line through `report`, the blocks are compiled again in the mode
    without CUDA graphs (after `torch._dynamo.reset()`, which clears every compiled cache of the process: the
    graph trees go, and the blocks compile anew within the recompile limit), and the step runs again from the
    random state it started with. `graphs` says whether CUDA graphs are still in use; `failure` holds the line."""

    def __init__(self, transformer, report=None, **options):
        self.transformer, self.options = transformer, options
        self.report = report or functools.partial(print, file=sys.stderr, flush=True)
        self.graphs, self.failure, self.steps = options.get("mode") in CUDA_GRAPH_MODES, None, 0
        compile_blocks(transformer, **options)

    def __call__(self, step):
        """`step()` (a whole training step: zero_grad, forward, backward, optimizer step) run once; its result."""
        self.steps += 1
        if not self.graphs:
            return step()
        random_state = _random_state()
        torch.compiler.cudagraph_mark_step_begin()
        try:
            return step()
        except RuntimeError as err:
            if CAPTURE_FAILURE not in str(err):
                raise
            why = " ".join(str(err).split()).removeprefix("TODO: ").split(". ")[0]
        plain = CUDA_GRAPH_MODES[self.options["mode"]]
        self.failure = (f"CUDA graphs off: the compiled blocks' graphs failed at step {self.steps} (torch: {why}); "
                        f"the step runs again and training goes on with the blocks compiled in mode {plain}")
        self.report(self.failure)
        self.graphs, self.options = False, {**self.options, "mode": plain}
        torch._dynamo.reset()
        blocks = family_blocks(self.transformer)
        _restore_forwards(blocks)
        _compile_forwards(blocks, self.options)  # where the checkpoint was (in the graphs or around them) it stays
        _set_random_state(random_state)
        return step()


def _random_state() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_random_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


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
