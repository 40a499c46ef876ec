"""Shared test helpers: tiny float64 towers and the unchunked reference gradient."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def pytest_terminal_summary(terminalreporter):
    from helpers import ERRORS

    if ERRORS:
        terminalreporter.write_line(
            f"float64 gradient checks: {len(ERRORS)}, largest relative error {max(ERRORS):.3e}")
