"""The sampler step loops never read the device from the host.

On a GPU, `float(t)`, `int(mask.sum())`, `t > 0` or `x.nonzero()` on a CUDA tensor make the host wait for
every queued kernel, once per step. Here the samplers run on the meta device, whose tensors have no values:
any such read raises. Copies from the host to the device (which also wait) are counted and must not grow
with the number of steps.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edm import EDMPrecond
from edm.guidance import ClassifierFreeGuidance, RoutingGuidance
from generation.generate import SAMPLERS
from rectified_flow import FlowPrecond


class Backbone(torch.nn.Module):
    """F(x, c_noise, y): no parameters, so it runs on the meta device; accepts routing keywords."""
    num_classes = 3

    def forward(self, x, noise, class_labels=None, **kwargs):
        return torch.tanh(x) * noise.reshape(-1, 1, 1, 1)


class HostToDevice(TorchDispatchMode):
    """Counts copies of host tensors to the meta device."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            sources = [a for a in args if torch.is_tensor(a)]
            if sources[-1].device.type == "cpu" and getattr(out, "device", None) == torch.device("meta"):
                self.copies += 1
        return out


def _nets():
    edm = EDMPrecond(Backbone())
    return {
        "edm": edm,
        "cfg+interval": ClassifierFreeGuidance(edm, 1.5, interval=(0.3, 5.0)),
        "routing+cfg": RoutingGuidance(ClassifierFreeGuidance(edm, 1.5), weak_ratio=0.7, strong_ratio=0.3, scale=1.5),
        "flow": FlowPrecond(Backbone()),
    }


SETTINGS = [("edm", {}), ("edm", {"S_churn": 20.0, "S_min": 0.05, "S_max": 50.0}), ("euler", {}),
            ("ablation", {"discretization": "vp", "schedule": "vp", "scaling": "vp"}),
            ("ablation", {"discretization": "iddpm", "S_churn": 5.0}), ("flow", {"solver": "heun"})]
# Every sampler with the plain denoiser and CFG inside an interval; routing guidance and the flow precond
# once each (they hold no decision of their own); the flow sampler reaches the wrappers through its denoiser view.
CASES = ([(name, kw, net) for name, kw in SETTINGS for net in ("edm", "cfg+interval") if name != "flow"] +
         [("edm", {}, "routing+cfg"), ("flow", {"solver": "heun"}, "edm"), ("flow", {"solver": "heun"}, "flow")])


@pytest.mark.parametrize("sampler, settings, net_name", CASES)
def test_step_loop_never_reads_the_device(sampler, settings, net_name):
    net = _nets()[net_name]
    labels = torch.tensor([0, 2], device="meta")
    copies = []
    for num_steps in (2, 5):
        latents = torch.randn(2, 4, 2, 2, device="meta")
        with HostToDevice() as mode:
            out = SAMPLERS[sampler](net, latents, labels, num_steps=num_steps, randn_like=torch.randn_like, **settings)
        assert out.device.type == "meta" and out.shape == latents.shape
        copies.append(mode.copies)
    assert copies[0] == copies[1], f"host-to-device copies grow with the steps: {copies}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampler, settings, net_name", CASES)
def test_step_loop_never_synchronises_a_gpu(sampler, settings, net_name):
    """The same on a real GPU: torch's sync debug mode raises on any host-device synchronisation."""
    net = _nets()[net_name]
    latents, labels = torch.randn(2, 4, 2, 2, device="cuda"), torch.tensor([0, 2], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = SAMPLERS[sampler](net, latents, labels, num_steps=4, randn_like=torch.randn_like, **settings)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
