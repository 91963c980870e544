"""Benchmarks of the orchestrator against torchrun (run `python -m benchmarks.bench_core`)."""
