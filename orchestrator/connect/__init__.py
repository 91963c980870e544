"""Reach Ray or start it, trusting only this user's: the cluster, the address found on this
machine, the probe, tokens, and the local runtime."""
