"""Training scripts written as each library's documentation shows, unchanged under torchrun,
`orchestrator run` and `distribute()` (tests/test_clients.py compares their results)."""
