"""Block families beside DiT's attention block (`dit.py` builds every model and holds the registry):
`ssm` (diffusion state-space blocks, "DiS") and `adaln`, the conditioning arithmetic they share; `sprint`,
the fusion module (mask token, 2C -> C projection) of a route with `fusion: sprint`."""
