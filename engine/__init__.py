"""zeroplus.engine: the thin orchestrator (forward, backward, step) and ``initialize``."""
