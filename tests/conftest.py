import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("ZEROPLUS_ACCELERATOR", "cpu")
