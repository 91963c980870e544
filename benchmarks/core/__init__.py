"""bench_core's sections, one module each; `common` holds what they share."""
