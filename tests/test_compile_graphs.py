"""The compiled routed model is one graph: dynamo traces the block loop's Python (routes, SPRINT's fusion, REPA's
tap, activation checkpointing) without a break. `scripts/compile_check.sh VERSION` runs this file under
another torch; `graph_counts` is what it prints."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from dit import get_model
from training.config_check import check_train_config
from training.repa import Tap
from tread_utils.errors import UserError

ROUTES = [dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=2),
          dict(selection_ratio=0.25, start_layer_idx=3, end_layer_idx=4, fusion="sprint")]


def tiny(**extra):
    torch.manual_seed(0)
    return get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, depth=6,
                                     hidden_size=32, num_heads=2, routes=ROUTES, **extra))


def graph_counts() -> dict:
    """name -> (graphs, breaks, first break reason) of one forward under torch._dynamo.explain."""
    x, t, y = torch.randn(4, 1, 16, 16), torch.rand(4), torch.randint(0, 10, (4,))
    calls = {"training (checkpointed, REPA tap inside a route)": (tiny(grad_checkpointing=True).train(),
                                                                 dict(repa_tap=Tap(2))),
             "sampling (forced ratio, deep path dropped)": (tiny().eval(),
                                                            dict(force_routing_ratio=0.5, drop_deep_path=True))}
    counts = {}
    for name, (model, kwargs) in calls.items():
        torch._dynamo.reset()
        found = torch._dynamo.explain(model)(x, t, y, **kwargs)
        reasons = [str(b.reason).splitlines()[0] for b in found.break_reasons]
        counts[name] = (found.graph_count, found.graph_break_count, reasons[0] if reasons else "")
    return counts


def test_routed_model_traces_into_one_graph_without_breaks():
    for name, (graphs, breaks, reason) in graph_counts().items():
        assert (graphs, breaks) == (1, 0), f"{name}: {graphs} graphs, {breaks} breaks, first: {reason}"


class Untestable:
    """A callable whose truth value is an error: dynamo (torch 2.11) breaks the graph where the block loop asks it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __bool__(self):
        raise TypeError("truth-tested")


def test_the_block_loop_never_truth_tests_the_tap():
    model = tiny().train()
    calls = []
    tap = Untestable(lambda hidden, keep_idx: calls.append((hidden.shape, keep_idx is not None)))
    tap.block = 2
    out = model(torch.randn(4, 1, 16, 16), torch.rand(4), torch.randint(0, 10, (4,)), repa_tap=tap)
    assert out.shape == (4, 1, 16, 16) and calls == [(torch.Size([4, 32, 32]), True)]  # block 2: route 0's 32 kept


@pytest.mark.parametrize("dynamic, graphs", [(True, 1), (False, 3)])
def test_train_compile_dynamic_choices_on_the_routed_model(dynamic, graphs):
    """train.compile_dynamic: true traces the batch size symbolically from the first call (the router's draw
    included), false compiles one graph per batch size."""
    from test_config_schema import compose_train

    torch._dynamo.reset()
    counter = CompileCounter()
    model = tiny().train()
    compiled = torch.compile(model, backend=counter, dynamic=dynamic)
    with torch.no_grad():
        for batch in (8, 5, 12):
            compiled(torch.randn(batch, 1, 16, 16), torch.rand(batch), torch.randint(0, 10, (batch,)))
    assert counter.frame_count == graphs
    assert check_train_config(compose_train(f"train.compile_dynamic={str(dynamic).lower()}")).config.train.compile_dynamic \
        is dynamic


def test_train_compile_dynamic_refuses_other_values():
    from test_config_schema import compose_train

    assert check_train_config(compose_train()).config.train.compile_dynamic is None  # torch's default
    with pytest.raises(UserError, match="train.compile_dynamic"):
        check_train_config(compose_train("train.compile_dynamic=sometimes"))
