import os

import pytest


def _has_cuda() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # pragma: no cover - no TVM CUDA runtime
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without CUDA)")
    config.addinivalue_line("markers", "slow: long-running (nvcc builds, large graphs)")


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_cpu_rng(request):
    """The CPU tier draws model weights and inputs from torch's global generator: seed it per
    test, so a verdict does not depend on which tests pytest-xdist ran before in that worker. The
    GPU tier keeps fresh random inputs per run (it draws from CUDA generators of its own)."""
    if "gpu" not in request.keywords:
        import torch

        torch.random.default_generator.manual_seed(0)
    yield
