"""zeroplus: a memory-first ZeRO-style training engine for PyTorch.

The top-level folders ``engine/``, ``offload/`` and ``kernels/`` are the subpackages ``zeroplus.engine``,
``zeroplus.offload`` and ``zeroplus.kernels`` (``package_dir``), and ``configs/`` is ``zeroplus/configs``:
only ``zeroplus.*`` is installed, so no top-level ``engine`` or ``kernels`` module shadows other packages.
Run from the source tree, ``zeroplus/source_tree.py`` maps the same names.
"""
from setuptools import find_packages, setup

MAPPED = ("engine", "offload", "kernels")  # zeroplus/source_tree.py's MAPPED
PACKAGES = find_packages(include=["zeroplus", "zeroplus.*"])
for _folder in MAPPED:
    PACKAGES += [f"zeroplus.{_folder}"] + [f"zeroplus.{_folder}.{sub}" for sub in find_packages(where=_folder)]

setup(
    name="zeroplus",
    version="0.1.0",
    description="Memory-first ZeRO-style training engine for PyTorch with DeepSpeed-compatible configs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES + ["zeroplus.configs"],
    package_dir={"zeroplus.configs": "configs", **{f"zeroplus.{folder}": folder for folder in MAPPED}},
    package_data={"zeroplus.configs": ["*.json"], "zeroplus.kernels": ["*.c"]},
    install_requires=["torch>=2.4", "numpy", "psutil", "pydantic>=2", "tqdm", "safetensors"],
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "npu": ["torch_npu"],
        "plotting": ["matplotlib"],
        "monitors": ["tensorboard==2.21.0", "wandb==0.31.0"],
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "ruff", "mypy==2.4.1", "transformers==5.23.0",
                 "accelerate==1.15.0", "peft==0.21.2", "trl==1.16.0", "bitsandbytes==0.50.2"],
    },
    entry_points={"console_scripts": ["zeroplus=zeroplus.cli:main"]},
)
