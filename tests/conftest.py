"""Shared fixtures and the test session's settings.

Under pytest-xdist (two workers on the 2-core machine) every worker and every process a test starts gets one
torch/OpenMP thread: two workers with two threads each would oversubscribe the cores.
"""
from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """CLIs and experiment scripts set the decoders' thread count for their process; a test that runs one in-process
    must not leave it to the next test."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def target():
    """The tiny float64 target most core tests use (files needing another shape define their own `target`)."""
    from core_helpers import tiny_target

    return tiny_target()
