"""What supervises a job in the cluster, apart from any driver: its output journal, so far."""
