"""Commands beside the three root scripts that a user of the product runs: export a trained model (export),
summarise runs and sweeps (report, report_plots), the configuration reference (config_doc), a random-weight
SD-VAE for offline runs (make_random_sdvae), the LoRA + TREAD fine-tuning example on diffusers models
(finetune_lora, diffusers_toy), and the import-layer check. Each runs as `python -m tools.<name>`; the
benchmarks, parity harness and study report that make the docs' numbers live in `lab/`."""
