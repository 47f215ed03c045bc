"""EDM (Karras et al. 2022): preconditioning, training loss, samplers and guidance wrappers."""
from edm.guidance import ClassifierFreeGuidance, NFECounter, RoutingGuidance
from edm.loss import EDMLoss
from edm.precond import EDMPrecond
from edm.sampler import SAMPLERS, StackedRandomGenerator, ablation_sampler, bind_sampler, edm_sampler, euler_sampler

__all__ = ["EDMLoss", "EDMPrecond", "ClassifierFreeGuidance", "NFECounter", "RoutingGuidance", "SAMPLERS",
           "StackedRandomGenerator", "ablation_sampler", "bind_sampler", "edm_sampler", "euler_sampler"]
