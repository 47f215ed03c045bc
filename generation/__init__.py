"""Sampling images from a trained denoiser: seeds, guidance, per-seed generation over processes, outputs.

`sample.py` is the command; the in-training evaluation and the benchmarks use the same functions."""
from generation.generate import (DEFAULT_SAMPLER, SAMPLERS, Samples, build_guided_net,
                                 count_network_evaluations, generate, make_sampler, save_samples_npz)
from generation.grids import render_grid, save_image_grid
from generation.seeds import parse_seeds

__all__ = ["DEFAULT_SAMPLER", "SAMPLERS", "Samples", "build_guided_net", "count_network_evaluations", "generate",
           "make_sampler", "render_grid", "save_image_grid", "save_samples_npz", "parse_seeds"]
