"""Shared fixtures: CUDA-marked tests skip cleanly without a GPU; helpers to run stock vs compiled steps."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    two_gpus = has_cuda and torch.cuda.device_count() >= 2
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and not two_gpus:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
