"""Seeing a job: its numbers over time (`series`), and the figures of each rank."""
