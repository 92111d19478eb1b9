"""zeroplus.engine"""
