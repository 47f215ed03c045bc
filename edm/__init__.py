"""EDM (Karras et al. 2022): preconditioning, training loss and samplers."""
from edm.loss import EDMLoss
from edm.precond import EDMPrecond

__all__ = ["EDMLoss", "EDMPrecond"]

from edm.guidance import ClassifierFreeGuidance, NFECounter, RoutingGuidance
from edm.sampler import (SAMPLERS, StackedRandomGenerator, ablation_sampler, edm_sampler, euler_sampler,
                         sampler_from_config)

__all__ += ["ClassifierFreeGuidance", "NFECounter", "RoutingGuidance", "SAMPLERS", "StackedRandomGenerator",
            "ablation_sampler", "edm_sampler", "euler_sampler", "sampler_from_config"]
