"""zeroplus.offload"""
