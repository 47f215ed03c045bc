"""Leaves that nothing imports: benchmarks, the paper-code loader and parity, reports, the digits classifier
trainer, the import-layer check. Each runs as `python -m tools.<name>`."""
