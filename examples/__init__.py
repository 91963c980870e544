"""Runnable examples: each file is a script, also importable as `examples.<name>`."""
