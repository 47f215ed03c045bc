"""The project's lowest layer, imported by everything and importing nothing of the project:
`errors` (one-line user errors and the CLI exit convention), `files` (atomic writes, output-path
checks, argparse helpers), `precision` (the TF32 policy) and `distributed` (starting processes with a
timeout, CPU threads, gathering to the main process)."""
