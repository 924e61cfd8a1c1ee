"""Shared test setup: `gpu` tests run only where torch sees a CUDA or ROCm device."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU; torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
