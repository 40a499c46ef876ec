"""The sharded step on 2 and 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count,
set in a fresh process by sharded_check.py) equals the one-device step and the unchunked
reference to 1e-10 in float64, and refuses a batch that does not split over the devices.
The 4-device run (about a minute of compiling on 2 cores) is marked slow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ERRORS

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_step_equals_one_device(devices):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, str(HERE / "sharded_check.py"), str(devices)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    err = float(re.search(r"largest relative error (\S+)", out.stdout).group(1))
    ERRORS.append(err)
    assert err < 1e-10
    assert "do not split over the" in out.stdout


def test_an_axis_the_mesh_does_not_have_is_refused():
    import jax
    from toy import EMBED

    from bigbatch.errors import ConfigError
    from bigbatch.jax import InfoNCE, sharded_value_and_grad

    mesh = jax.make_mesh((1,), ("batch",))
    with pytest.raises(ConfigError, match="not an axis of the mesh"):
        sharded_value_and_grad(EMBED, InfoNCE(), 2, mesh, axis_name="x")
    with pytest.raises(ConfigError, match="chunk_size"):
        sharded_value_and_grad(EMBED, InfoNCE(), 0, mesh)
