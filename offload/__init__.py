"""zeroplus.offload: memory tiers (host, files) and what lives on them.

``tiers.py``: HostTier and FileTier (swap attention, cpu_checkpointing, optimizer-state offload).
``optimizer_states.py``: a flat group's optimizer states in sub-groups on a tier.
``tier_tensor.py``: a tensor kept on a tier for good, read and rewritten by ranges (the stage-3
master shards of ``offload_param``). ``disk_space.py``: the free-space check at initialisation.
"""
