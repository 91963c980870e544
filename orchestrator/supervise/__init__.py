"""A detached job (`distribute(..., detach=True)`): supervised in the cluster, apart from any
driver, and followed, or got back, from any process."""
