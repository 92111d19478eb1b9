"""zeroplus.offload: memory tiers (host, files) and optimizer states streamed through them.

``tiers.py``: HostTier and FileTier (used by swap attention, cpu_checkpointing and optimizer-state
offload). ``optimizer_states.py``: a flat group's optimizer states in sub-groups on a tier.
Parameter offload (``offload_param``) is parsed and validated but not built yet.
"""
