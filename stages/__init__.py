"""Thin DVC entry points: each wires params.yaml to one library call (run as `python -m stages.<name>`)."""
