"""Chunk sizes from a memory budget (``GradCache(chunk_size="auto")``, ``bigbatch train
--grad-cache-chunk auto``): what one step holds at its peak, by part (:class:`StepMemory`),
what one chunk's activations cost per row, measured on a probe (:func:`activation_bytes`,
:class:`ActivationCost`), and the largest chunk per tower whose step fits the budget
(:func:`choose_chunks`, which returns a :class:`ChunkPlan`).

The peak of a step, with ``c_t`` rows per chunk of tower ``t``::

    floor + max_t activations_t(c_t) + one loss block <= budget

where the floor is what the batch needs whatever the chunk: the cached embeddings and their
gradients, one random state per replayed chunk, the parameters' gradients, the optimizer's
states and a negative queue's documents (:data:`QUEUE_COPIES` times). A chunk's activations
grow linearly with its rows at a given width (``per_row x rows + fixed``), measured at the
width of the longest rows, so a chunk of shorter rows costs less. With a token budget
(``chunk_tokens="auto"``) the same room is divided by the cost of one token at that width
(the largest per token, since attention grows with the width). When every tower's whole
batch fits at once with its graph kept, the step is plain training: one pass, no replay
(:attr:`ChunkPlan.plain`).

Padding is weighed too (:func:`padding_cap`): where chunks hold length-sorted rows, each
padded to its own longest, a chunk of a tower's short rows (queries, say) that fits the
budget whole can still cost more time than smaller ones, since one chunk pads every row to
the batch's longest. Its size is halved while that cuts the tower's padded tokens by more
than :data:`PADDING_TOLERANCE` (all-MiniLM-L6-v2 on 128 SciFact claims, 12 to 46 tokens:
one chunk of 128 pads them to 5,888 tokens and takes twice the time of 8 chunks of 16,
3,056 tokens).

Also here: the free memory of a device (:func:`free_memory`), a budget as bytes or a
fraction of it (:func:`budget_bytes`), the optimizer's states (:func:`optimizer_state_bytes`)
and the measured peak of a step (:class:`PeakMemory`), which checks the choice.

Only torch: a loss tells its own size through ``memory_hint`` (see
:meth:`bigbatch.engine.gradcache.GradCache.plan_chunks`); the training loop's options are
read by :mod:`bigbatch.train`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["StepMemory", "ActivationCost", "ChunkPlan", "activation_bytes", "choose_chunks",
           "free_memory", "check_budget", "budget_bytes", "optimizer_state_bytes", "PeakMemory",
           "CPU_RNG_STATE_BYTES", "DEVICE_RNG_STATE_BYTES", "OPTIMIZER_STATES", "ACTIVATION_MARGIN",
           "STEP_OVERHEAD", "MiB", "PADDING_TOLERANCE", "QUEUE_COPIES", "QUEUE_ID_BYTES", "queue_bytes",
           "padded_tokens", "padding_cap"]

MiB = 2 ** 20

CPU_RNG_STATE_BYTES = 5056
"""Size of ``torch.get_rng_state()``: what each replayed chunk's CPU random state holds."""

DEVICE_RNG_STATE_BYTES = 16  # a CUDA (Philox) generator: seed and offset

ACTIVATION_MARGIN = 1.1
"""A probe's saved tensors are what a chunk keeps for its backward; the backward itself holds
one layer's gradients beside them at a time (all-MiniLM-L6-v2 at 256 tokens on the CPU: a
step's peak 1% above the count), so a chunk's cost is counted this much larger."""

STEP_OVERHEAD = 16 * MiB
"""What a step allocates beyond its tensors' count whatever its size (the autograd engine's
and the libraries' own buffers: 4 to 6 MB measured on the CPU with a tiny BERT), counted with
each chunk's activations."""

PADDING_TOLERANCE = 0.10
"""A tower's chunk is halved while its rows in chunks of half the size pad to more than this
fraction fewer tokens (:func:`padding_cap`). A tower's time goes with its padded tokens:
all-MiniLM-L6-v2's forward and backward of 128 SciFact claims on one CPU thread took 9.5 s
in one chunk (5,888 tokens), 5.7 s in 2 (4,224), 4.4-5.2 s in 4 (3,424), 4.1-4.7 s in 8
(3,056) and 4.3-4.7 s in 16 (2,880): below about 10% fewer tokens, the extra chunks cost
what the padding saved."""

QUEUE_COPIES = 3
"""A negative queue's documents are held this many times at a step's peak: each step's
embeddings as queued, their joined copy (:meth:`bigbatch.losses.queue.NegativeQueue.queued`)
and the loss's columns, the batch's documents then the queued ones."""

QUEUE_ID_BYTES = 16
"""What a queued document holds beside its embedding: its id and the id of the query it came
with (int64 each, :class:`bigbatch.losses.queue.NegativeQueue`)."""


def queue_bytes(rows: int, row_bytes: int) -> int:
    """A negative queue of ``rows`` documents at a step's peak: each document's embedding
    (``row_bytes``) and its two ids, held :data:`QUEUE_COPIES` times."""
    return QUEUE_COPIES * rows * (row_bytes + QUEUE_ID_BYTES)

# tensors per parameter an optimizer keeps, before its first step has made them (Adam's
# two moments, momentum's one); an optimizer not named here is counted as Adam
OPTIMIZER_STATES: dict[str, int] = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Adagrad": 1,
    "RMSprop": 1, "ASGD": 1, "Rprop": 2, "SGD": 1, "LBFGS": 2,
}


@dataclass(frozen=True)
class StepMemory:
    """Bytes one step adds at its peak, by part: the cached embeddings and their gradients,
    the random states of the replayed chunks, the parameters' gradients, the optimizer's
    states (from its first step on), one chunk's activations, one block of the loss, and
    the embeddings a negative queue keeps from earlier steps (``--negative-queue``)."""

    embeddings: int
    embedding_grads: int
    rng_states: int
    parameter_grads: int
    chunk_activations: int
    loss_block: int
    optimizer_states: int = 0
    negative_queue: int = 0

    @property
    def floor(self) -> int:
        """What the batch needs whatever the chunk: embeddings, their gradients, random
        states, the parameters' gradients, the optimizer's states and a negative queue's
        embeddings."""
        return (self.embeddings + self.embedding_grads + self.rng_states + self.parameter_grads
                + self.optimizer_states + self.negative_queue)

    @property
    def total(self) -> int:
        """The estimated peak: the floor plus one chunk's activations and one loss block."""
        return self.floor + self.chunk_activations + self.loss_block

    def as_mb(self) -> dict[str, float]:
        """Every part, the floor and the total in MiB."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out |= {"floor": self.floor, "total": self.total}
        return {k: v / MiB for k, v in out.items()}


@dataclass(frozen=True)
class ActivationCost:
    """What one chunk of a tower keeps for its backward: ``per_row x rows + fixed`` bytes,
    measured on rows ``width`` tokens wide (0: not tokenized); ``row_bytes``: what one row's
    embedding takes in the cache."""

    per_row: float
    fixed: int = 0
    width: int = 0
    row_bytes: int = 0

    def of(self, rows: int) -> int:
        """Bytes of a chunk of ``rows`` rows."""
        return math.ceil(self.per_row * rows + self.fixed) if rows > 0 else 0

    def rows_in(self, room: int) -> int:
        """The most rows whose chunk fits ``room`` bytes (0: not one)."""
        if room < self.of(1):
            return 0
        if self.per_row <= 0:
            return 2 ** 62
        return max(1, int((room - self.fixed) // self.per_row))

    @property
    def per_token(self) -> float:
        """Bytes of one token at the measured width (the most any token costs)."""
        return self.per_row / max(self.width, 1)

    def scaled(self, factor: float) -> "ActivationCost":
        return dataclasses.replace(self, per_row=self.per_row * factor,
                                   fixed=math.ceil(self.fixed * factor))


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk sizes chosen for a memory budget, and the step's estimated peak at them.

    Attributes:
        sizes: rows per chunk per tower (with a token budget, the most rows a chunk holds).
        tokens: token budgets per chunk (empty: chunks cut by rows alone).
        plain: every tower's batch in one chunk with its graph kept: plain training (one
            pass, nothing replayed).
        memory: the estimate (:class:`StepMemory`) at these sizes.
        budget: the budget in bytes.
        rows: rows per tower in a step.
        costs: the measured activation costs, per tower sized by them.
        base: the floor's parts and the loss block, without random states and activations.
        rng_state_bytes: one replayed chunk's random states.
        transient: the largest parameter's gradient: a replay's new gradient is made whole
            before it is added into ``.grad``, when the chunk's activations are mostly freed,
            so a step's activation term is at least this.
        fits: rows per chunk that fit the budget, for towers whose chunk :func:`padding_cap`
            made smaller (empty: none).
    """

    sizes: dict[str, int]
    tokens: dict[str, int]
    plain: bool
    memory: StepMemory
    budget: int
    rows: dict[str, int]
    costs: dict[str, ActivationCost] = field(default_factory=dict)
    base: StepMemory | None = None
    rng_state_bytes: int = CPU_RNG_STATE_BYTES
    transient: int = 0
    fits: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """The sizes as the start line shows them, e.g. ``chunk 24 (queries 128)``."""
        def one(name: str) -> str:
            if name in self.tokens:
                return f"{self.tokens[name]:,} tokens"
            if self.sizes[name] >= self.rows[name]:
                return "the whole batch"
            if name in self.fits:
                return f"{self.sizes[name]} ({self.fits[name]} fit; fewer rows pad less)"
            return str(self.sizes[name])
        parts = [f"{name} {one(name)}" for name in self.sizes]
        mode = "plain training, one pass" if self.plain else ", ".join(parts)
        return (f"{mode} (auto, for a memory budget of {self.budget / MiB:,.0f} MB: step "
                f"~{self.memory.total / MiB:,.0f} MB)")

    def lowered(self, measured: int) -> "ChunkPlan":
        """The plan for the next steps after a step whose measured peak (bytes, the
        optimizer's states included) went over the budget: each tower's activations
        counted larger by what the estimate missed, so every chunk gets smaller (by one
        row at least, down to one).

        Raises:
            ConfigError: a plan without measured costs (nothing to lower by).
        """
        if not self.costs or self.base is None:
            raise ConfigError("this chunk plan has no measured costs to lower")
        acts = max(self.memory.chunk_activations, 1)
        factor = max(1.0, (measured - (self.memory.total - acts)) / acts) * 1.05
        costs = {t: c.scaled(factor) for t, c in self.costs.items()}
        given = {t: s for t, s in self.sizes.items() if t not in self.costs}
        try:
            plan = choose_chunks(self.budget, self.rows, costs, base=self.base, given=given,
                                 token_towers=set(self.tokens), row_caps=self.sizes,
                                 allow_plain=False, rng_state_bytes=self.rng_state_bytes,
                                 transient=self.transient)
        except ConfigError:  # not even one row fits by the new count: one row each
            plan = self
        sizes = {t: min(s, max(1, self.sizes[t] - 1)) if t in costs and t not in self.tokens
                 else s for t, s in plan.sizes.items()}
        tokens = {t: min(v, max(costs[t].width, self.tokens[t] - 1))
                  for t, v in plan.tokens.items()}
        return dataclasses.replace(plan, sizes=sizes, tokens=tokens, plain=False,
                                   costs=self.costs, budget=self.budget)

    def at(self, sizes: Mapping[str, int], tokens: Mapping[str, int] | None = None,
           plain: bool = False) -> "ChunkPlan":
        """This plan at other sizes (a resumed run's), its estimate computed again."""
        tokens = dict(tokens or {})
        memory = _estimate(self.base, self.rows, self.costs, dict(sizes), tokens, plain,
                           self.rng_state_bytes, self.transient)
        return dataclasses.replace(self, sizes=dict(sizes), tokens=tokens, plain=plain,
                                   memory=memory)


def _chunk_count(rows: int, size: int, cost: ActivationCost | None, tokens: int | None) -> int:
    """Chunks of a tower's batch (with a token budget: at most, since each chunk holds as
    many rows of the longest width as fit)."""
    if tokens is not None and cost is not None:
        size = min(size, max(1, tokens // max(cost.width, 1)))
    return -(-rows // max(size, 1))


def _activations(t: str, cost: ActivationCost | None, size: int, tokens: int | None) -> int:
    if cost is None:
        return 0
    if tokens is not None:  # rows x width <= tokens, each token at most per_token
        return math.ceil(cost.per_token * tokens + cost.fixed)
    return cost.of(size)


def _estimate(base: StepMemory, rows: Mapping[str, int], costs: Mapping[str, ActivationCost],
              sizes: Mapping[str, int], tokens: Mapping[str, int], plain: bool,
              rng_state_bytes: int, transient: int = 0) -> StepMemory:
    acts = [_activations(t, costs.get(t), sizes[t], tokens.get(t)) for t in sizes]
    if plain:
        return dataclasses.replace(base, rng_states=0,
                                   chunk_activations=max(sum(acts), transient))
    chunks = sum(_chunk_count(rows[t], sizes[t], costs.get(t), tokens.get(t)) for t in sizes)
    return dataclasses.replace(base, rng_states=max(chunks - 1, 0) * rng_state_bytes,
                               chunk_activations=max(*acts, transient, 0))


def choose_chunks(budget: int, rows: Mapping[str, int], costs: Mapping[str, ActivationCost], *,
                  base: StepMemory, given: Mapping[str, int] | None = None,
                  token_towers: Collection[str] = (), row_caps: Mapping[str, int] | None = None,
                  allow_plain: bool = True, rng_state_bytes: int = CPU_RNG_STATE_BYTES,
                  transient: int = 0, budget_name: str = "memory_budget") -> ChunkPlan:
    """The largest chunk per tower whose step fits ``budget`` bytes.

    Args:
        budget: bytes the step may hold at its peak (the optimizer's states included).
        rows: rows per tower in a step.
        costs: the activation cost of each tower to size (a tower left out, such as one
            without trainable parameters, keeps its ``given`` size, or the largest chunk
            chosen).
        base: the floor's parts and the loss block (:class:`StepMemory`; its random states
            and activations are ignored): the parts come from the caller, who knows how its
            parameters and optimizer are held (sharded or not).
        given: fixed rows per chunk for towers not sized here (their cost still counts).
        token_towers: towers cut by a token budget (then ``row_caps`` bounds their rows).
        row_caps: the most rows per chunk per tower (default: its rows, the whole batch).
        allow_plain: choose plain training (every graph kept, one pass) when it fits.
        rng_state_bytes: one replayed chunk's random states.
        transient: the largest parameter's gradient (see :class:`ChunkPlan`).
        budget_name: how the error names the budget (``--memory-budget``).

    Returns:
        the :class:`ChunkPlan`.

    Raises:
        ConfigError: not even one row per chunk fits; the message names the smallest budget
            that works.
    """
    given = dict(given or {})
    base = dataclasses.replace(base, rng_states=0, chunk_activations=0)
    caps = {t: min(rows[t], (row_caps or {}).get(t, rows[t])) for t in rows}
    tokens_of = set(token_towers) & set(costs)
    loss = base.loss_block
    if allow_plain and not tokens_of and all(given.get(t, rows[t]) >= rows[t] for t in rows):
        sizes = dict(rows)
        memory = _estimate(base, rows, costs, sizes, {}, True, rng_state_bytes, transient)
        if memory.total <= budget:
            return ChunkPlan(sizes, {}, True, memory, budget, dict(rows), dict(costs), base,
                             rng_state_bytes, transient)
    smallest = {t: 1 for t in costs} | given
    rng = 0
    for _ in range(64):  # the random states grow as the chunks shrink: settle them
        room = budget - base.floor - rng - loss
        if transient > room:  # not even the largest parameter's gradient fits beside the floor
            _too_small(budget, base, costs, rows, smallest, rng_state_bytes, budget_name,
                       transient)
        sizes, tokens = dict(given), {}
        for t, cost in costs.items():
            if t in given:
                continue
            if t in tokens_of:
                budget_t = int((room - cost.fixed) // max(cost.per_token, 1e-9))
                if budget_t < max(cost.width, 1):
                    _too_small(budget, base, costs, rows, smallest, rng_state_bytes, budget_name,
                               transient)
                tokens[t], sizes[t] = budget_t, caps[t]
            else:
                n = min(caps[t], cost.rows_in(room))
                if n < 1:
                    _too_small(budget, base, costs, rows, smallest, rng_state_bytes, budget_name,
                               transient)
                sizes[t] = n
        for t in rows:  # towers sized by nothing: the largest chunk chosen
            sizes.setdefault(t, min(caps[t], max((sizes[u] for u in costs), default=caps[t])))
        memory = _estimate(base, rows, costs, sizes, tokens, False, rng_state_bytes, transient)
        if memory.rng_states <= rng:
            break
        rng = memory.rng_states
    if memory.total > budget:  # a given size, or the transient, that does not fit
        _too_small(budget, base, costs, rows, smallest, rng_state_bytes, budget_name, transient)
    return ChunkPlan(sizes, tokens, False, memory, budget, dict(rows), dict(costs), base,
                     rng_state_bytes, transient)


def padded_tokens(lengths: Sequence[int], size: int) -> int:
    """Tokens that rows of ``lengths`` (in the order they are chunked) fill in chunks of
    ``size`` rows, each chunk padded to its own longest row."""
    size = max(size, 1)
    return sum(max(lengths[i:i + size]) * len(lengths[i:i + size])
               for i in range(0, len(lengths), size))


def padding_cap(lengths: Sequence[int], size: int,
                tolerance: float = PADDING_TOLERANCE) -> int:
    """``size`` halved (rounded up) while chunks of half as many rows pad ``lengths`` (the
    rows in chunk order: length-sorted) to more than ``tolerance`` fewer tokens; ``size``
    itself where halving saves less (rows of about one length), at least 1."""
    size = max(1, min(size, len(lengths)))
    while size > 1:
        half = -(-size // 2)
        if padded_tokens(lengths, size) <= (1 + tolerance) * padded_tokens(lengths, half):
            break
        size = half
    return size


def _too_small(budget: int, base: StepMemory, costs: Mapping[str, ActivationCost],
               rows: Mapping[str, int], sizes: Mapping[str, int], rng_state_bytes: int,
               budget_name: str, transient: int = 0) -> None:
    need = _estimate(base, rows, costs, {**{t: 1 for t in rows}, **sizes}, {}, False,
                     rng_state_bytes, transient)
    mb = need.as_mb()
    smallest = math.ceil(need.total / MiB)
    raise ConfigError(
        f"{budget_name}: {budget / MiB:,.0f} MB cannot hold a training step of even one row "
        f"per chunk, which needs {smallest:,} MB: cached embeddings and their gradients "
        f"{mb['embeddings'] + mb['embedding_grads']:,.0f} MB, parameter gradients "
        f"{mb['parameter_grads']:,.0f} MB, optimizer states {mb['optimizer_states']:,.0f} MB, "
        f"one loss block {mb['loss_block']:,.0f} MB, "
        + (f"the negative queue {mb['negative_queue']:,.0f} MB, " if need.negative_queue else "")
        + f"one row's activations "
        f"{mb['chunk_activations']:,.0f} MB; give a budget of {smallest:,}MB or more (or lower "
        f"the batch size or the max length)")


def activation_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn()`` (e.g. a tower on a
    probe chunk): run it once with gradients, count the memory the saved tensors span (a
    storage saved several times, or through several views, is counted once; a view counts
    only the part of its storage it reaches, so a probe chunk sliced from a large batch is
    not charged for the batch), and drop the graph. Storages of ``params`` (the model's
    parameters) are not counted: they exist anyway."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    spans: dict[int, list[tuple[int, int]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        # (a parameter saved for the backward is a weight: under FSDP the gathered one)
        if ptr not in skip and t.numel() and not isinstance(t, torch.nn.Parameter):
            reach = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
            lo = t.storage_offset() * t.element_size()
            spans.setdefault(ptr, []).append((lo, lo + reach * t.element_size()))
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    total = 0
    for parts in spans.values():  # the union of the byte ranges saved from each storage
        end = -1
        for lo, hi in sorted(parts):
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total


def free_memory(device: torch.device | str) -> int | None:
    """Bytes the device can still give: CUDA's free memory (``torch.cuda.mem_get_info``), or
    the host's available memory (``MemAvailable``) for the CPU; None where it cannot be
    read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) * 1024 if m else None


def check_budget(budget: Any, name: str = "memory_budget") -> None:
    """Refuse a budget that is neither bytes (an int > 0) nor a fraction (a float in (0, 1]).

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ConfigError(f"{name} must be bytes (an int) or a fraction of the free memory "
                          f"(a float in (0, 1]), got {budget!r}")
    if isinstance(budget, int) and budget <= 0:
        raise ConfigError(f"{name} must be > 0 bytes, got {budget}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ConfigError(f"{name}: a fraction of the free memory must be in (0, 1], got "
                          f"{budget!r} (give bytes as an int)")


def budget_bytes(budget: int | float, device: torch.device | str,
                 name: str = "memory_budget") -> int:
    """``budget`` in bytes: an int is bytes, a float in (0, 1] the fraction of the device's
    free memory (:func:`free_memory`) now.

    Raises:
        ConfigError: a budget that is neither, or a fraction where free memory cannot be read.
    """
    check_budget(budget, name)
    if isinstance(budget, int):
        return budget
    free = free_memory(device)
    if free is None:
        raise ConfigError(f"{name}: the free memory of {device} cannot be read here; give "
                          f"the budget in bytes")
    return int(budget * free)


def optimizer_state_bytes(optimizer: Any, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of the optimizer's states: those it holds, or, for parameters it holds none for
    yet (before its first step), :data:`OPTIMIZER_STATES` tensors the size of each (SGD
    without momentum: none). ``params``: the parameters to count (default: the optimizer's)."""
    if optimizer is None:
        return 0
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
    name = type(optimizer).__name__
    per_param = OPTIMIZER_STATES.get(name, 2)
    if name == "SGD" and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        per_param = 0
    total = 0
    for p in params:
        state = optimizer.state.get(p)
        if state:
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        elif p.requires_grad:
            total += per_param * p.numel() * p.element_size()
    return total


class PeakMemory:
    """The peak memory a block of code adds (bytes, in :attr:`peak` after the block):
    ``torch.cuda.max_memory_allocated`` above what was allocated before it on a CUDA device;
    on the CPU the process's resident high-water mark above its resident memory before it
    (Linux: ``/proc/self/clear_refs`` resets the mark; elsewhere ``getrusage``, which counts
    only a peak above the process's earlier ones). ``peak`` is None where neither can be read.

    Example::

        with PeakMemory("cuda") as meter:
            cache.step(query=q, doc=d)
        print(meter.peak)
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak: int | None = None
        self._base = 0
        self._reset = False

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset = True
            self._base = _status_bytes("VmRSS") or 0
        except OSError:
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        high = _status_bytes("VmHWM") if self._reset else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = None if high is None else max(0, high - self._base)


def _status_bytes(key: str) -> int | None:
    """A ``/proc/self/status`` memory field in bytes; None where it cannot be read."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) * 1024 if m else None
