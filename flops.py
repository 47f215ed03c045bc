"""FLOP counts of one training step (forward + backward), measured with torch.utils.flop_counter on
meta tensors: no memory, no compute, exact shapes. The paper's "Gflops" are multiply-accumulates;
these are FLOPs (2 per MAC)."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from dit import get_model


def training_step_flops(backbone_type: str, params: dict, batch_size: int, routing: bool = True) -> int:
    """FLOPs of forward + backward for one batch; `routing=False` counts the same model unrouted."""
    params = dict(params)
    with torch.device("meta"):
        model = get_model(backbone_type, params).to("meta")
    model.train()
    model.router.enable_routing = routing
    C, H = params["in_channels"], params["input_size"]
    x = torch.randn(batch_size, C, H, H, device="meta")
    t = torch.randn(batch_size, device="meta")
    y = torch.zeros(batch_size, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x, t, y).sum().backward()
    return counter.get_total_flops()


def routing_flop_report(backbone_type: str, params: dict, batch_size: int) -> dict:
    """Training-step FLOPs with and without the configured routes, and the speed-up bound they imply."""
    routed = training_step_flops(backbone_type, params, batch_size, routing=True)
    dense = training_step_flops(backbone_type, params, batch_size, routing=False)
    return {"flops_per_step_dense": dense, "flops_per_step_routed": routed, "flop_speedup_bound": dense / routed}
