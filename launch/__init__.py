"""Processes and places: the CLI, the dev mode, the Ray mode, model preparation.

No request logic."""
