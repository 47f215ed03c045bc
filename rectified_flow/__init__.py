"""Rectified flow / SiT-style objective: linear interpolant x_t = (1 - t) x0 + t eps, velocity prediction
v = eps - x0, logit-normal time sampling, Euler and Heun ODE samplers from t = 1 to t = 0.

`FlowPrecond` also exposes the model as an EDM-convention denoiser `net(x, sigma, labels)` (sigma =
t / (1 - t), x = x_t / (1 - t)), so EDM's samplers and the guidance wrappers work on it unchanged.
"""
from rectified_flow.loss import RFLoss
from rectified_flow.precond import FlowPrecond
from rectified_flow.sampler import flow_sampler

__all__ = ["RFLoss", "FlowPrecond", "flow_sampler"]
