"""torch.compile on a routed diffusers transformer, as trainers compile it: as many graphs as the unrouted model,
no break, no recompile after the first call, and the compiled model routes what the eager one does."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")
from diffusers_tiny import build, one_per_family, shared_checks  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

FAMILIES = one_per_family(shared_checks())  # Lumina2, Ernie and MiniMax H3: their own test files compile them
ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}


def sample(out):
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one latent per sample


def compiled_steps(model, inputs, seeds, handle=None):
    """Training steps (forward and backward) of the compiled model with the eager backend: (graphs compiled,
    graph breaks, each step's output and kept tokens); each step's output is checked against the eager model's."""
    torch._dynamo.reset()
    counters["graph_break"].clear()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    kept = []
    for seed in seeds:
        torch.manual_seed(seed)
        out = sample(compiled(**inputs)[0])
        out.square().mean().backward()
        if handle is not None:
            kept.append(handle.last_keep[0].clone())
            torch.manual_seed(seed)
            assert torch.equal(sample(model(**inputs)[0]), out)  # the eager routed forward, same draw
            assert torch.equal(handle.last_keep[0], kept[-1])
    return counter.frame_count, sum(counters["graph_break"].values()), kept


@pytest.mark.parametrize("name", FAMILIES)
def test_routed_model_compiles_as_the_unrouted_one(name):
    model, inputs, _ = build(name)
    model.train()
    model(**inputs)  # eager first: Z-Image fills its RoPE cache on its first call, a graph break of its own
    unrouted, _, _ = compiled_steps(model, inputs, [0])
    handle = apply_tread(model, ROUTE)
    graphs, breaks, kept = compiled_steps(model, inputs, [0, 1, 2], handle)
    assert (graphs, breaks) == (unrouted, 0), dict(counters["graph_break"])  # no recompile after the first call
    assert not torch.equal(kept[0], kept[1])  # each call draws anew: no selection baked into the graph


def test_a_compiled_model_is_refused_with_the_order_to_follow():
    model, inputs, _ = build("sd3")
    compiled = torch.compile(model, backend="eager")
    for target in (compiled, model.compile(backend="eager") or model):
        with pytest.raises(UserError, match="call apply_tread on the model first, then torch.compile") as err:
            apply_tread(target, ROUTE)
        assert "\n" not in str(err.value) and not model._forward_pre_hooks


def test_compiled_blocks_route_as_eager_with_a_few_shared_graphs():
    """compile_blocks: each block's forward compiled, the routing hooks eager around it. With gradient
    checkpointing, a routed FLUX gives the eager model's kept tokens and gradients, the blocks of a class share
    their graphs (5 for 9 blocks, as many at any depth: per class, full and kept length, and the first
    single-stream block's input, a view of the joint sequence, has strides of its own), and a second call compiles
    nothing more."""
    from tread_diffusers import compile_blocks

    def steps(model, handle):
        grads = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            model.zero_grad()
            sample(model(**inputs)[0]).square().mean().backward()
            grads.append((handle.last_keep[0].clone(), [p.grad.clone() for p in model.parameters()]))
        return grads

    eager, inputs, _ = build("flux", layers=3, single_layers=6)
    compiled, _, _ = build("flux", layers=3, single_layers=6)
    for model in (eager, compiled):
        model.enable_gradient_checkpointing()
        model.train()
    expected = steps(eager, apply_tread(eager, ROUTE))
    handle = apply_tread(compiled, ROUTE)
    torch._dynamo.reset()
    counters["graph_break"].clear()
    counter = CompileCounter()
    blocks = compile_blocks(compiled, backend=counter)
    assert blocks == 9
    got = steps(compiled, handle)
    for (keep, grads), (keep_eager, grads_eager) in zip(got, expected):
        assert torch.equal(keep, keep_eager) and all(torch.equal(a, b) for a, b in zip(grads, grads_eager))
    assert not torch.equal(got[0][0], got[1][0])
    assert (counter.frame_count, sum(counters["graph_break"].values())) == (5, 0), dict(counters["graph_break"])
    assert compile_blocks(compiled, backend=counter) == blocks and counter.frame_count == 5


def test_compiled_blocks_recompute_inside_their_graphs():
    """With gradient checkpointing on, compile_blocks puts the checkpoint inside each block's graph: backward
    recomputes there, so a block is called once per step, not again through its hooks in backward; with
    torch.compile's partitioner (aot_eager) the routed gradients are the eager model's. A module that is not a
    compiled block still goes through diffusers' checkpoint, and checkpointing switched on after compile_blocks
    still checkpoints (outside the graphs)."""
    from tread_diffusers import compile_blocks

    def step(model, handle, seed=0):
        torch.manual_seed(seed)
        model.zero_grad()
        sample(model(**inputs)[0]).square().mean().backward()
        return handle.last_keep[0].clone(), [p.grad.clone() for p in model.parameters()]

    eager, inputs, _ = build("flux", layers=2, single_layers=3)
    compiled, _, _ = build("flux", layers=2, single_layers=3)
    for model in (eager, compiled):
        model.enable_gradient_checkpointing()
        model.train()
    keep_eager, grads_eager = step(eager, apply_tread(eager, ROUTE))
    handle = apply_tread(compiled, ROUTE)
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager")
    calls = []
    for block in (*compiled.transformer_blocks, *compiled.single_transformer_blocks):
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    keep, grads = step(compiled, handle)
    assert len(calls) == 5  # one call per block; the checkpoint outside the graphs calls each twice
    assert torch.equal(keep, keep_eager)
    for got, expected in zip(grads, grads_eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    plain = torch.nn.Linear(4, 4)
    seen = []
    original = compiled._gradient_checkpointing_func

    def recording(module, *args):
        seen.append(module)
        return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)
    compiled._gradient_checkpointing_func = recording
    compile_blocks(compiled, backend="aot_eager")  # the blocks are compiled already; the function is wrapped anew
    x = torch.randn(2, 4, requires_grad=True)
    compiled._gradient_checkpointing_func(plain, x).sum().backward()
    assert seen == [plain] and x.grad is not None
    assert original is not compiled._gradient_checkpointing_func

    late, _, _ = build("flux", layers=2, single_layers=3)
    late.train()
    compile_blocks(late, backend="aot_eager")
    late.enable_gradient_checkpointing()
    late_handle = apply_tread(late, ROUTE)  # routes attach to compiled blocks too (the forward's signature kept)
    calls.clear()
    for block in (*late.transformer_blocks, *late.single_transformer_blocks):
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    keep_late, grads_late = step(late, late_handle)
    assert len(calls) == 10 and torch.equal(keep_late, keep_eager)  # checkpointed around the compiled blocks
    for got, expected in zip(grads_late, grads_eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
