"""tvm-evt: a training compiler for PyTorch models on TVM Relax with CUTLASS EVT epilogue fusion."""
from setuptools import setup

setup(
    name="tvm-evt",
    version="0.1.0",
    description="Training compiler for PyTorch models: TVM Relax training graphs with "
    "CUTLASS SM90 Epilogue-Visitor-Tree fusion",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[
        "tvm_evt",
        "tvm_evt.relax_passes",
        "tvm_evt.relax_passes.training",
        "tvm_evt.relax_passes.ops",
        "tvm_evt.relax_passes.graph",
        "tvm_evt.relax_passes.partition",
        "tvm_evt.relax_passes.lower",
        "tvm_evt.codegen",
        "tvm_evt.codegen.backend",
        "tvm_evt.codegen.build",
        "tvm_evt.codegen.frontend",
        "tvm_evt.codegen.ir",
        "tvm_evt.codegen.passes",
    ],
    package_dir={
        "tvm_evt": "python/tvm_evt",
        "tvm_evt.relax_passes": "relax_passes",
        "tvm_evt.codegen": "codegen",
    },
    install_requires=[
        "apache-tvm==0.27.0.post1",
        "numpy",
        "torch>=2.4",
        "mip>=2.0,<3",
        "highspy==1.15.1",  # python-mip 2.0 finds HiGHS in its layout; 1.16.0 moved the library ("HiGHS not found")
        "xgboost",
        "nvidia-cutlass==4.2.0.0",
        "tqdm",
    ],
    extras_require={
        # the tests draw the report PNGs, run the tuning flow and train modules transformers builds
        "test": ["pytest>=7", "pytest-xdist", "matplotlib", "cloudpickle", "psutil", "transformers"],
        "bench": ["matplotlib"],
        "tune": ["cloudpickle", "psutil"],  # MetaSchedule's process pools
    },
    entry_points={"console_scripts": ["tvm-evt=tvm_evt.cli:main"]},
)
