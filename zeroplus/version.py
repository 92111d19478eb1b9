"""zeroplus's version, in a leaf module: the DeepSpeed API's shim reads it without importing the top."""

__version__ = "0.1.0"
