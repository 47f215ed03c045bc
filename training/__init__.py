"""What train.py needs beyond the model, data and diffuser formulas: the loop in phases, checkpoints, the
optimizer, the `diffuser` dispatch, run logging and the run directory, the FLOP report, the in-training evaluator."""
