"""Tests of the CUDA path. Marked `gpu` (module `pytestmark`); pyproject's `-m "not gpu"` deselects them by default,
and `scripts/gpu_check.sh` runs them with `-m gpu`. Asked for on a machine without CUDA, they skip."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
