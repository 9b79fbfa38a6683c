import pytest


def _has_cuda() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # pragma: no cover - no TVM CUDA runtime
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without CUDA)")
    config.addinivalue_line("markers", "slow: minutes of nvcc or CPU; the CPU tier runs them with -m slow "
                            "(the GPU tier's slow tests run with -m gpu)")


def pytest_collection_modifyitems(config, items):
    slow = "slow" in (config.option.markexpr or "")
    cuda = _has_cuda()
    skip_slow = pytest.mark.skip(reason="minutes of nvcc or CPU: run with -m slow")
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        elif "slow" in item.keywords and "gpu" not in item.keywords and not slow:
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed_cpu_rng(request):
    """The CPU tier draws model weights and inputs from torch's global generator: seed it per
    test, so a verdict does not depend on which tests pytest-xdist ran before in that worker. The
    GPU tier keeps fresh random inputs per run (it draws from CUDA generators of its own)."""
    if "gpu" not in request.keywords:
        import torch

        torch.random.default_generator.manual_seed(0)
    yield
