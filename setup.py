"""zeroplus: a memory-first ZeRO-style training engine for PyTorch.

The top-level folders ``engine/``, ``offload/`` and ``kernels/`` are linked into the
``zeroplus`` namespace (``zeroplus/engine -> ../engine``), so only ``zeroplus.*`` is
installed and no top-level ``engine`` or ``kernels`` module shadows other packages.
"""
from setuptools import find_packages, setup

setup(
    name="zeroplus",
    version="0.1.0",
    description="Memory-first ZeRO-style training engine for PyTorch with DeepSpeed-compatible configs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["zeroplus", "zeroplus.*"]),
    package_data={"zeroplus": ["configs/*.json"]},
    install_requires=["torch>=2.4", "numpy", "psutil", "pydantic>=2", "tqdm", "safetensors"],
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "npu": ["torch_npu"],
        "plotting": ["matplotlib"],
        "test": ["pytest>=7", "pytest-timeout", "ruff", "mypy==2.4.1", "transformers==5.23.0", "accelerate==1.15.0",
                 "peft==0.21.2", "trl==1.16.0", "bitsandbytes==0.50.2"],
    },
    entry_points={"console_scripts": ["zeroplus=zeroplus.cli:main"]},
)
