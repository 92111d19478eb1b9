"""zeroplus.offload: memory tiers (device, host, NVMe file) and streamed optimizer states.

Empty until the offload issue builds it; ``offload_optimizer`` / ``offload_param`` are already
parsed and validated by the config layer, and initialisation warns that they have no effect yet.
"""
