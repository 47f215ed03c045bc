"""The project's lowest layer, imported by everything and importing nothing of the project:
`errors` (one-line user errors and the CLI exit convention) and `files` (atomic writes, output-path
checks, argparse helpers)."""
