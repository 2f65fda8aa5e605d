"""Packaging for nemo_fp8_recipes.

Install for development with ``pip install -e ".[dev]"``. PyTorch is a requirement but is
deliberately left unpinned above its floor: pick the build you need (CPU or CUDA) first, e.g.
``pip install torch==2.13.0`` on a CPU machine, then install this package.
"""

from setuptools import find_packages, setup

setup(
    name="nemo_fp8_recipes",
    version="0.1.0",
    description="FP8 training recipes (delayed, tensorwise, blockwise, MXFP8) for NeMo / Megatron "
    "and plain PyTorch, with a precision policy that is audited at run time.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["nemo_fp8_recipes", "nemo_fp8_recipes.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.5",
        "numpy",
        "pyyaml",
        "tqdm",
        # the embedded trainer (nemo-fp8-train) is the main job: its config and logging stack
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3",
        "tensorboard>=2.14",
        "matplotlib>=3.7",  # nemo-fp8-compare plots
    ],
    extras_require={
        "dev": [
            "pytest>=7",
            "pytest-xdist>=3",  # the test command runs on every core (-n auto)
            # Triton: real kernels on GPU; on CPU its interpreter checks the kernels bit-exactly
            "triton>=3.2; platform_system == 'Linux'",
            # lint and format check (ruff.toml; tests/test_architecture.py runs it): pinned, since
            # its rules and formatting change between releases
            "ruff==0.17.6",
            # tests/nn/test_hf_moe.py, test_grouped_convert.py: tiny Mixtral / DeepSeek-V3 built offline
            # (grouped experts, 3-D weights; .ci/run adds transformers 4.57 in a directory of its own)
            "transformers==5.25.0",
        ],
        "megatron": ["megatron-core>=0.13"],
        # Hydra's submitit launcher for users who prefer `hydra/launcher=submitit_slurm`
        "slurm": ["hydra-submitit-launcher>=1.2"],
        # Transformer Engine needs CUDA + cuDNN; documented, never installed in CI.
        "te": ["transformer_engine[pytorch]>=2.9"],
    },
    entry_points={
        "console_scripts": [
            "nemo-fp8-train=nemo_fp8_recipes.train:main",
            "nemo-fp8-check=nemo_fp8_recipes.integrations.validate:main",
            "nemo-fp8-submit=nemo_fp8_recipes.launch.submit:main",
            "nemo-fp8-compare=nemo_fp8_recipes.compare:main",
        ]
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
