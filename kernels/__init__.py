"""zeroplus.kernels"""
