"""Fixtures shared by the test files."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny float64 tensors: intra-op threads only add sync cost (10x slower on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
