"""The fast paths keep results and do not recompile: torch.compile with routing, activation
checkpointing, the foreach EMA update, the fused AdamW."""
import torch
from torch._dynamo.utils import counters

from dit import get_model
from edm import EDMLoss, EDMPrecond
from training.loop import update_ema


def tiny(**extra):
    torch.manual_seed(0)
    return get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, depth=4,
                                     hidden_size=32, num_heads=2, **extra,
                                     routes=[dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=2)]))


def test_compile_with_routing_compiles_once_without_graph_breaks():
    torch._dynamo.reset()
    counters.clear()
    model = tiny()
    net = EDMPrecond(model)
    net.model = torch.compile(model, backend="eager")  # dynamo's tracing and guards, no C++ build
    loss_fn, opt = EDMLoss(), torch.optim.AdamW(model.parameters())
    x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
    for _ in range(4):  # a fresh random token choice every step: same shapes, no recompilation
        loss_fn(net, x, y).mean().backward()
        opt.step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compile_with_routing_survives_a_changing_batch_size():
    """A partial last batch or a CFG-doubled batch: dynamo marks the batch dimension dynamic after the
    second size and must trace the router's draw symbolically: one recompile, then none."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny()
    net = EDMPrecond(model)
    net.model = torch.compile(model, backend="eager")
    graphs = []
    for batch in (8, 16, 5, 12, 8):
        x, y = torch.randn(batch, 1, 16, 16), torch.randint(0, 10, (batch,))
        EDMLoss()(net, x, y).mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2, 2, 2]
    assert not counters["graph_break"]


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for flag in (False, True):
        model = tiny(grad_checkpointing=flag).train()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else None
        torch.manual_seed(1)
        x, t, y = torch.randn(4, 1, 16, 16), torch.rand(4), torch.randint(0, 10, (4,))
        model(x, t, y).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_foreach_ema_matches_the_formula():
    ema = [torch.randn(3, 3), torch.randn(5)]
    params = [torch.randn(3, 3), torch.randn(5)]
    expect = [e * 0.99 + p * 0.01 for e, p in zip(ema, params)]
    update_ema(ema, params, 0.99)
    for a, b in zip(ema, expect):
        assert torch.allclose(a, b, atol=1e-7)


def test_training_optimizer_is_fused_and_matches_the_reference_adamw():
    from training.loop import build_adamw, fused_adamw_available

    a, b = tiny(), tiny()
    opt_fast = build_adamw(a.parameters(), lr=1e-3, weight_decay=0.01)
    opt_ref = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    # stated independently of the helper: torch >= 2.4 has a fused AdamW kernel for CPU and CUDA, none for meta
    assert opt_fast.defaults["fused"] is True
    assert [fused_adamw_available(d) for d in ("cpu", "cuda", "meta")] == [True, True, False]
    for step in range(3):
        for model in (a, b):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
        opt_fast.step()
        opt_ref.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
