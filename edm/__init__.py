"""EDM (Karras et al. 2022): preconditioning, training loss and samplers."""
from edm.loss import EDMLoss
from edm.precond import EDMPrecond

__all__ = ["EDMLoss", "EDMPrecond"]
