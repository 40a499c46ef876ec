"""Set-up for every test folder: the root of tests/ on ``sys.path``, so the helper modules
several folders share (helpers, pipeline_helpers, dist_helpers, multivector_helpers,
objectives_helpers) import by name; record indexes in a cache folder of this run; one seed
per test; the float64 gradient checks' summary."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# indexes of training records (and corpus embeddings) go to a folder of this session, not
# to the user's ~/.cache/bigbatch
if "BIGBATCH_CACHE" not in os.environ:
    os.environ["BIGBATCH_CACHE"] = tempfile.mkdtemp(prefix="bigbatch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["BIGBATCH_CACHE"], True)

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
