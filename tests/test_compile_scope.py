"""train.compile_scope=blocks: each block compiled on its own, the block loop and the routing eager. Blocks of a
type share their graphs (one per input shape, not one per block), dynamo never breaks one, training computes the
uncompiled losses, and the run's log counts the graphs as with the whole model. Dynamo's `eager` backend: its
tracing, guards and graph counts without inductor's C++ build (tests/test_cuda.py compiles with inductor)."""
import json
import re

import pytest
import torch
import torch._dynamo
from hydra import compose, initialize_config_dir
from torch._dynamo.utils import counters

from conftest import REPO, TINY_MODEL
from dit import get_model
from edm import EDMLoss, EDMPrecond
from training import loop
from training.compile import compile_backbone
from training.config_check import check_train_config
from tread_utils.errors import UserError

# TREAD's route, then SPRINT's: the routed blocks see 32 and 48 of the 64 tokens
ROUTES = [dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=2),
          dict(selection_ratio=0.25, start_layer_idx=4, end_layer_idx=5, fusion="sprint")]


def tiny(block_type):
    torch.manual_seed(0)
    return get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, depth=8,
                                     hidden_size=32, num_heads=2, routes=ROUTES, block_type=block_type,
                                     grad_checkpointing=True))


def train_steps(model, steps=3) -> tuple:
    """(losses, dynamo's compiled frames after each step) of `steps` bf16 training steps on seeded data (the
    float32 block after each route runs outside autocast, as the authors' code runs it)."""
    net, loss_fn = EDMPrecond(model), EDMLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    losses, frames = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(net, x, y).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        frames.append(int(counters["frames"]["total"]))
    return losses, frames


@pytest.mark.parametrize("block_type", ["attention", "ssm", "lightningdit"])
def test_blocks_share_three_graphs_and_train_like_the_eager_model(block_type):
    """Eight blocks, two routes (TREAD's and SPRINT's fusion), activation checkpointing: four graphs in the first
    step, none after: the full sequence, the routed one (traced dynamic at the second kept count), the float32
    block after a route, and the final layer (compiled as the authors' code compiles it)."""
    expected, _ = train_steps(tiny(block_type))
    torch._dynamo.reset()
    counters.clear()
    model = tiny(block_type)
    keys = list(model.state_dict())
    assert compile_backbone(model, "blocks", backend="eager") is model  # compiled in place, called as before
    losses, frames = train_steps(model)
    assert counters["stats"]["unique_graphs"] == 4 and frames == [4, 4, 4]
    assert not counters["graph_break"]
    assert list(model.state_dict()) == keys  # checkpoints keep their keys (no `_orig_mod.`)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)


def symbolic_graphs(dynamic) -> list:
    """For each graph dynamo compiles in three training steps of the attention model compiled per block with
    torch.compile's `dynamic`, in order: whether it was traced with a symbolic size."""
    def symbolic(value):
        return isinstance(value, torch.SymInt) or \
            isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))

    traced = []

    def backend(graph, example_inputs):
        traced.append(any(map(symbolic, example_inputs)))
        return graph.forward

    torch._dynamo.reset()
    counters.clear()
    model = tiny("attention")
    compile_backbone(model, "blocks", backend=backend, dynamic=dynamic)
    _, frames = train_steps(model)
    assert frames[0] == frames[-1] == len(traced)  # all in the first step
    return traced


def test_blocks_graphs_are_dynamic_after_the_first_shape_unless_compiled_static():
    """train.compile_dynamic=null (torch's default): a block's first graph is static (the blocks before the route:
    the full sequence in the patch embedder's transposed layout), the next shape (the routed one) traces the
    sequence length and strides as symbols, and that graph serves every later block, the float32 block after the
    route excepted, whose graph is dynamic too: all but the first blocks run dynamic graphs, where `dit` (one
    layout, one shape) and the whole model stay static. train.compile_dynamic=false: every graph static, one per
    shape and layout."""
    # first blocks, routed (32 tokens), float32 block, final layer
    assert symbolic_graphs(None) == [False, True, True, False]
    # first blocks, routed (32), float32 block, SPRINT's routed (48), blocks after a route (contiguous), final layer
    assert symbolic_graphs(False) == [False] * 6


def train_run(tmp_path, name, *overrides) -> list:
    """The log records of a 3-step bf16 run of an 8-block routed model (route 1 -> 5) through the training loop."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", f"run_name={name}", *TINY_MODEL,
                                           "model.params.depth=8", "model.params.routes.0.start_layer_idx=1",
                                           "model.params.routes.0.end_layer_idx=5", "train.general.batch_size=8",
                                           "train.general.num_workers=0", "train.eval.eval_interval=0",
                                           "train.logging.tensorboard=false", "train.logging.log_interval=1",
                                           "train.mixed_precision=bf16", "train.max_steps=3", *overrides])
    checked = check_train_config(cfg, world_size=1)
    loop.training_loop(checked)
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def test_train_compile_scope_blocks_logs_three_graphs_and_the_uncompiled_losses(tmp_path, monkeypatch):
    """train.compile_scope=blocks through the training loop: eight blocks, four graphs (full sequence, routed,
    float32 block after the route, final layer), no recompile after the first step, no graph break, and the losses of the same
    run uncompiled."""
    eager = train_run(tmp_path, "eager", "train.compile=false")
    torch._dynamo.reset()
    counters.clear()
    # the trainer's inductor as the eager backend; config.patch, not monkeypatch: undoing a monkeypatch deletes
    # the config entry, and every later compile in the process fails
    with torch._dynamo.config.patch(debug_backend_override=">=0:eager"):
        blocks = train_run(tmp_path, "blocks", "train.compile=true", "train.compile_scope=blocks")
    assert [(r["compiled_graphs"], r["recompiles_after_first_step"]) for r in blocks] == [(4, 0)] * 3
    assert not counters["graph_break"]
    assert all("compiled_graphs" not in r for r in eager)
    torch.testing.assert_close([r["loss"] for r in blocks], [r["loss"] for r in eager], rtol=1e-5, atol=0)


def test_train_compile_dynamic_false_keeps_each_block_graph_static(tmp_path):
    """train.compile_scope=blocks train.compile_dynamic=false through the training loop: one static graph per block
    shape and layout, four (the first block, the routed ones, the float32 block, the blocks after the route) and
    the final layer's, all in the first step."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(debug_backend_override=">=0:eager"):
        static = train_run(tmp_path, "static", "train.compile=true", "train.compile_scope=blocks",
                           "train.compile_dynamic=false")
    assert [(r["compiled_graphs"], r["recompiles_after_first_step"]) for r in static] == [(5, 0)] * 3
    assert not counters["graph_break"]


def test_train_compile_scope_is_model_or_blocks():
    from test_config_schema import compose_train

    assert check_train_config(compose_train()).config.train.compile_scope == "model"  # the whole model, as before
    with pytest.raises(UserError, match=re.escape("train.compile_scope=layers is not allowed: it must be one of "
                                                  "model, blocks")):
        check_train_config(compose_train("train.compile_scope=layers"))
