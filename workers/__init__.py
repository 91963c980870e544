"""Actor side: everything here runs inside a Ray actor; it never imports `orchestrator`."""
