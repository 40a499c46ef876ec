"""Random-state capture and replay, so a re-run forward draws the same dropout masks.

GradCache runs every chunk twice: once without gradients to get its embeddings and
once with gradients to backpropagate the cached embedding gradients. With dropout
on, the second run must draw exactly the random numbers the first one drew, or the
gradient would belong to a different network. :class:`RandContext` records the
state of the CPU generator and of the generator of every accelerator device that
the chunk's tensors live on (plus the current accelerator device, which kernels
launched without an explicit tensor use), and restores those states on entry. On
exit the states in force before entry are put back, so replaying a chunk does not
change the random stream of the code that follows.

Works with no accelerator at all (only the CPU generator is captured), with CUDA,
and with any backend that ``torch.get_device_module`` knows (XPU, MPS, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["RandContext", "devices_of"]


def devices_of(*objs: Any) -> list[torch.device]:
    """Return the non-CPU devices of every tensor found in ``objs`` (searched through
    dicts, lists and tuples), in first-seen order, without duplicates."""
    seen: dict[torch.device, None] = {}
    stack = list(objs)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                dev = obj.device
                if dev.index is None:
                    dev = torch.device(dev.type, _device_module(dev.type).current_device())
                seen.setdefault(dev, None)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return list(seen)


def _device_module(device_type: str) -> Any:
    return torch.get_device_module(device_type)


def _current_accelerator() -> torch.device | None:
    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return None
    dev = accel.current_accelerator()
    if dev is None:
        return None
    return torch.device(dev.type, accel.current_device_index())


def _get_state(dev: torch.device) -> torch.Tensor:
    mod = _device_module(dev.type)
    try:
        return mod.get_rng_state(dev)
    except TypeError:  # backends with a single generator take no device argument
        return mod.get_rng_state()


def _set_state(dev: torch.device, state: torch.Tensor) -> None:
    mod = _device_module(dev.type)
    try:
        mod.set_rng_state(state, dev)
    except TypeError:
        mod.set_rng_state(state)


class RandContext:
    """Capture the random state now; replay it inside ``with ctx:``.

    Args:
        *objs: the chunk's inputs (tensors, or dicts/lists of them). Their devices,
            and the current accelerator device, get their generator state captured.
        devices: further devices whose generator state to capture (for example the device
            a chunk will be moved to after it is collated); CPU entries are ignored.

    Example::

        ctx = RandContext(batch)          # before the no-grad forward
        with torch.no_grad():
            cached = model(batch)
        with ctx:                         # replays the same dropout masks
            out = model(batch)
    """

    def __init__(self, *objs: Any, devices: Iterable[torch.device | str] = ()) -> None:
        found = devices_of(*objs)
        for dev in [_current_accelerator(), *(torch.device(d) for d in devices)]:
            if dev is not None and dev.type != "cpu":
                if dev.index is None:
                    dev = torch.device(dev.type, _device_module(dev.type).current_device())
                if dev not in found:
                    found.append(dev)
        self.devices: list[torch.device] = found
        self.cpu_state: torch.Tensor = torch.get_rng_state()
        self.device_states: list[torch.Tensor] = [_get_state(d) for d in found]
        self._outer: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def include(self, *objs: Any) -> None:
        """Also capture, as of now, the generator of every device of ``objs`` not yet captured
        (e.g. where a collate function put a chunk). Call it before the forward pass."""
        for dev in devices_of(*objs):
            if dev not in self.devices:
                self.devices.append(dev)
                self.device_states.append(_get_state(dev))

    def __enter__(self) -> "RandContext":
        self._outer.append((torch.get_rng_state(), [_get_state(d) for d in self.devices]))
        torch.set_rng_state(self.cpu_state)
        for dev, state in zip(self.devices, self.device_states):
            _set_state(dev, state)
        return self

    def __exit__(self, *exc: object) -> None:
        cpu_state, dev_states = self._outer.pop()
        torch.set_rng_state(cpu_state)
        for dev, state in zip(self.devices, dev_states):
            _set_state(dev, state)
