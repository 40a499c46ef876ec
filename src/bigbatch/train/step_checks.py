"""Steps that cannot teach the model anything, named as they happen: a step whose loss and
gradient are both 0 (every query scores only its own positive: a one-document corpus, one
pair repeated, negatives that are all the positive), and a step whose logits overflow (a
fixed temperature so small that the softmax saturates: losses of millions, gradients of
nothing but noise). Each is a warning, once per run and kind; with ``--strict`` it stops
the run instead. The step's values are the same on every rank (the global loss, the global
gradient norm), so every rank decides alike.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

__all__ = ["OVERFLOW_LOSS", "OVERFLOW_SCALE", "step_problem", "StepChecks"]

OVERFLOW_LOSS = 1e3  # an InfoNCE loss beyond this: logits far beyond any softmax's range
OVERFLOW_SCALE = 1e4  # 1 / temperature beyond this (the learnable one is kept at <= 100)


def step_problem(values: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, what is wrong) of a step by its logged values (``loss``, ``grad_norm``,
    ``temperature``), or None for a step that can teach."""
    loss, grad = values.get("loss"), values.get("grad_norm")
    temperature = values.get("temperature")
    if loss == 0 and grad == 0:
        return "zero", ("its loss and gradient are 0: no query has a negative to tell its "
                        "positive from (a one-document corpus, one pair repeated, negatives "
                        "equal to the positive?), so nothing is learned; give the data more "
                        "distinct documents or hard negatives")
    scale = 1 / temperature if isinstance(temperature, float) and temperature > 0 else None
    if (isinstance(loss, float) and math.isfinite(loss) and loss > OVERFLOW_LOSS) or \
            (scale is not None and scale > OVERFLOW_SCALE):
        reach = f" (similarities / temperature {temperature:g} reach ±{scale:.3g})" if scale \
            else ""
        return "overflow", (f"its loss is {loss:.4g}: the logits overflow{reach} and the "
                            f"softmax saturates, so the gradient says nothing; give a "
                            f"--temperature of 0.01 or more")
    return None


class StepChecks:
    """The checks of one run: each kind warned about once (``warn``: print it; the main
    rank), or raised with ``strict``."""

    def __init__(self, strict: bool, warn: bool) -> None:
        self.strict, self.warn = strict, warn
        self.seen: dict[str, int] = {}  # kind -> steps found

    def check(self, step: int, values: dict[str, Any]) -> None:
        """Warn about (or with ``strict`` stop at) step ``step`` when it cannot teach.

        Raises:
            ConfigError: with ``strict``, naming the step and what is wrong.
        """
        found = step_problem(values)
        if found is None:
            return
        kind, why = found
        if self.strict:
            raise ConfigError(f"--strict: step {step}: {why}")
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if self.warn and self.seen[kind] == 1:
            print(f"bigbatch train: warning: step {step}: {why} (further such steps are "
                  f"counted in summary.json; --strict stops the run instead)", flush=True)
