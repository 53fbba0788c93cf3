"""Shared test set-up."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tensors in unit tests are small; on a busy 2-core box intra-op threads only add
    synchronisation cost (and two processes with two threads each thrash)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
