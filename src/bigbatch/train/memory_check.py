"""The memory guard rail of ``bigbatch train``. With ``--grad-cache-chunk auto`` (the
default) the chunks are sized for ``--memory-budget`` from a probe of the data's longest texts
(:func:`plan_run_chunks`, the choice in :mod:`bigbatch.engine.sizing`); with a fixed chunk,
before the first step, estimate what one GradCache step will add
(:func:`bigbatch.train.memory_estimate.estimate_step_memory`: the cached embeddings and their
gradients, per-chunk random states, the parameters' gradients, one loss block, and one
chunk's activations measured on a probe chunk of the training data). Either way the start line
says so, and the run stops with the numbers and what to lower when the estimate exceeds the
memory the device has free.

Every probe runs a tower with gradients under a forked random state (so the run's dropout
draws are those it would have drawn without the probe: resuming and the demo's figures are
unchanged), and keeps nothing. After the first step of an auto-sized run the step's measured
peak is compared with the estimate (:func:`check_first_step`), and the chunks are lowered
once when it went over the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..engine import chunking
from ..engine.sizing import ChunkPlan, MiB, free_memory, optimizer_state_bytes
from ..errors import ConfigError
from .memory_estimate import StepMemory, activation_bytes, estimate_step_memory

__all__ = ["estimate_run_step", "free_memory", "check_fits", "describe", "plan_run_chunks",
           "probe_inputs", "sample_lengths", "queued_rows", "check_first_step", "describe_sizes",
           "LONGEST_SCAN", "LENGTH_SAMPLE"]

LONGEST_SCAN = 20_000  # records whose texts are searched for the longest (evenly spread)
LENGTH_SAMPLE = 4096  # texts per side tokenized for the auto sizing's padding rule
_LONGEST_TOKENIZED = 8  # of those, the longest by characters are tokenized to find the widest


def plan_run_chunks(cache: Any, encoder: Any, records: Sequence[Any], config: Any,
                    world_size: int, trainable: list[torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer, k: int | None = None) -> ChunkPlan:
    """Size the run's ``auto`` chunks for ``--memory-budget`` and use them
    (:meth:`bigbatch.GradCache.plan_chunks`): each tower measured on rows as wide as the
    data's longest text of its side (:func:`probe_inputs`), a step of ``--batch-size``
    queries and ``(1 + k)`` documents per query, the trainable parameters' gradients and
    AdamW's two states for each. Under torchrun every rank calls it and all take the
    smallest sizes. ``k``: hard negatives per query (default ``--num-hard-negatives``).

    Raises:
        ConfigError: a budget that cannot hold one row per chunk, naming the smallest that can.
    """
    k = config.num_hard_negatives if k is None else k
    rows = {name: config.batch_size * (1 if name == "query" else 1 + k) for name in cache.towers}
    probe = {name: probe_inputs(encoder, records, name, config) for name in cache.towers}
    lengths = {name: n for name in cache.towers
               if (n := sample_lengths(encoder, records, name, config, rows[name])) is not None}
    params = sum(p.numel() * p.element_size() for p in trainable) + \
        sum(p.numel() * p.element_size() for p in cache.loss_fn.parameters() if p.requires_grad)
    return cache.plan_chunks(probe, rows=rows, budget=config.memory_budget,
                             parameter_bytes=params,
                             optimizer_bytes=optimizer_state_bytes(optimizer),
                             world_size=world_size if cache.cross_device else 1,
                             budget_name="--memory-budget", lengths=lengths,
                             queued_rows=queued_rows(config, rows.get("doc", 0) * world_size))


def sample_lengths(encoder: Any, records: Sequence[Any], side: str, config: Any,
                   rows: int) -> list[int] | None:
    """Token counts of up to ``rows`` (at most :data:`LENGTH_SAMPLE`) texts of a side spread
    over the data, as the step tokenizes them: what a step's rows pad to, for the auto
    sizing's padding rule (:func:`bigbatch.engine.sizing.padding_cap`). None where the side
    is not text, or is collated chunk by chunk."""
    if encoder.collate_fns() is not None:
        return None
    want = min(rows, LENGTH_SAMPLE)
    items = _side_items(records, side, want)
    texts = [t for t in items if isinstance(t, str)][:want]
    if not texts or len(texts) < min(want, len(items)):
        return None
    max_length = config.query_max_length if side == "query" else None
    return encoder.step_inputs(texts, side, max_length=max_length)["attention_mask"].sum(1).tolist()


def probe_inputs(encoder: Any, records: Sequence[Any], side: str, config: Any,
                 rows: int = 4) -> Any:
    """``rows`` copies of the longest text of a side (queries; documents: positives and
    negatives) among :data:`LONGEST_SCAN` records spread over the data, as the step
    tokenizes it (cut at ``--max-length``, queries at ``--query-max-length``), so the probe's
    width bounds every step's; documents that are not text (page images): the first ones."""
    items = _side_items(records, side, LONGEST_SCAN)
    texts = [t for t in items if isinstance(t, str)]
    max_length = config.query_max_length if side == "query" else None
    if len(texts) < len(items):  # images: as they come
        return encoder.step_inputs(items[:rows], side)
    if encoder.collate_fns() is not None:  # collated chunk by chunk: the longest by characters
        return encoder.step_inputs([max(texts, key=len)] * rows, side)
    longest = sorted(texts, key=len, reverse=True)[:_LONGEST_TOKENIZED]
    widths = encoder.step_inputs(longest, side, max_length=max_length)["attention_mask"].sum(1)
    widest = longest[int(widths.argmax())]
    return encoder.step_inputs([widest] * rows, side, max_length=max_length)


def _side_items(records: Sequence[Any], side: str, count: int) -> list[Any]:
    """The texts (or page images) of a side, queries or documents (positives and
    negatives), of up to ``count`` records spread evenly over the data."""
    step = max(1, len(records) // max(1, count))
    picked = [records[i] for i in range(0, len(records), step)][:count]
    if side == "query":
        return [r.query for r in picked]
    return [d for r in picked for d in (r.positive, *r.negatives)]


def check_first_step(plan: ChunkPlan, peak: int | None, optimizer: torch.optim.Optimizer
                     ) -> tuple[str, ChunkPlan | None]:
    """After the first step: the step's measured peak (bytes above the memory before it, or
    None where it cannot be measured) plus the optimizer's states as they now are, against
    the plan's estimate and budget. Returns what the log says, and the lowered plan for the
    next steps when the peak went over the budget (else None)."""
    if peak is None:
        return "the step's peak memory cannot be measured here", None
    states = optimizer_state_bytes(optimizer)
    measured = peak + states
    text = (f"step 1 peaked at {measured / MiB:,.0f} MB (its own {peak / MiB:,.0f} MB and "
            f"the optimizer's states {states / MiB:,.0f} MB) against an estimate of "
            f"{plan.memory.total / MiB:,.0f} MB and a budget of {plan.budget / MiB:,.0f} MB")
    if measured <= plan.budget:
        return text, None
    lowered = plan.lowered(measured)
    return (f"{text}: over the budget, so the chunks are lowered for the next steps from "
            f"{_sizes(plan)} to {_sizes(lowered)}"), lowered


def describe_sizes(plan: ChunkPlan | None, sizes: dict[str, int], tokens: dict[str, int]
                   ) -> str:
    """The chunk sizes as the start line shows them: ``chunk 8 (queries 64)``, the token
    budgets, plain training, and with ``plan`` the budget they were sized for."""
    chunk = sizes.get("doc", sizes["query"])  # (corpus negatives: no document tower)
    text = f"chunk {chunk}" + (f" (queries {sizes['query']})" if sizes["query"] != chunk else "")
    if tokens:
        tok = tokens.get("doc", tokens.get("query"))
        text += f", {tok:,} tokens per chunk" + (
            f" (queries {tokens['query']:,})" if tokens.get("query", tok) != tok else "")
    if plan is None:
        return text
    if plan.plain:
        text = f"chunk {chunk}: the whole batch in one pass (plain training)"
    if plan.fits:
        text += " (" + ", ".join(f"{_SIDES.get(n, n)} {plan.fits[n]} fit" for n in plan.fits) + \
            ": smaller length-sorted chunks pad less)"
    return f"{text}, sized for a memory budget of {plan.budget / MiB:,.0f} MB"


_SIDES = {"query": "queries", "doc": "documents"}


def _sizes(plan: ChunkPlan) -> str:
    return ", ".join(f"{name} {plan.tokens[name]:,} tokens" if name in plan.tokens
                     else f"{name} {size}" for name, size in plan.sizes.items())


def estimate_run_step(cache: Any, encoder: Any, records: Sequence[Any], config: Any,
                      device: torch.device, world_size: int,
                      trainable: list[torch.nn.Parameter],
                      k: int | None = None) -> StepMemory | None:
    """The estimated peak one step of this run adds, or None where the towers return token
    embeddings (multi-vector) or the run trains against a fixed corpus (query-side tuning's
    corpus negatives), whose sizes this estimate does not model. ``k``: hard negatives per
    query (default ``--num-hard-negatives``; in a mix, the largest source's)."""
    if config.pooling == "multivector" or config.doc_negatives == "corpus":
        return None
    local = config.batch_size  # per process
    k = config.num_hard_negatives if k is None else k
    docs = [records[i].positive for i in range(min(cache.chunk_sizes["doc"], len(records)))]
    inputs = encoder.step_inputs(docs, "doc")
    chunks, _ = cache.split_inputs("doc", inputs, cache.chunk_sizes["doc"])
    probe = chunking.to_device(chunking.materialize(chunks[0]), cache.device or device)
    dim: list[int] = []

    def run() -> Any:
        out = cache.embed("doc", probe)
        dim.append(out.shape[-1])
        return out

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        acts = activation_bytes(run, trainable)
    params = sum(p.numel() * p.element_size() for p in trainable)
    global_docs = local * world_size * (1 + k)
    return estimate_step_memory({"query": local, "doc": local * (1 + k)}, dim[0],
                                chunk_size=cache.chunk_sizes, chunk_activation_bytes=acts,
                                parameter_bytes=params, loss_rows=local,
                                loss_columns=global_docs, block_size=config.loss_block_size
                                or None, dense=config.loss_block_size == 0, masked=True,
                                queued_rows=queued_rows(config, global_docs))


def queued_rows(config: Any, global_docs: int) -> int:
    """The documents ``--negative-queue`` holds once full: that many steps of the global
    batch's documents (0 without a queue)."""
    return (config.negative_queue or 0) * global_docs


def describe(estimate: StepMemory) -> str:
    """The estimate as the start line shows it."""
    mb = estimate.as_mb()
    states = f", optimizer states {mb['optimizer_states']:,.0f} MB" \
        if estimate.optimizer_states else ""
    if estimate.negative_queue:
        states += f", negative queue {mb['negative_queue']:,.0f} MB"
    return (f"step memory ~{mb['total']:,.0f} MB (estimate: cached embeddings and their "
            f"gradients {mb['embeddings'] + mb['embedding_grads']:,.0f} MB, parameter gradients "
            f"{mb['parameter_grads']:,.0f} MB{states}, one chunk "
            f"{mb['chunk_activations']:,.0f} MB, one loss block {mb['loss_block']:,.0f} MB)")


def check_fits(estimate: StepMemory, free: int | None, device: torch.device) -> None:
    """Raise ConfigError, with the numbers and what to lower, when ``estimate`` exceeds
    ``free`` bytes."""
    if free is None or estimate.total <= free:
        return
    mb = estimate.as_mb()
    raise ConfigError(
        f"one training step needs about {mb['total']:,.0f} MB but {device} has "
        f"{free / MiB:,.0f} MB free: cached embeddings and their gradients "
        f"{mb['embeddings'] + mb['embedding_grads']:,.0f} MB (lower --batch-size or "
        f"--num-hard-negatives), one chunk's activations {mb['chunk_activations']:,.0f} MB "
        f"(lower --grad-cache-chunk or --max-length), one loss block {mb['loss_block']:,.0f} "
        f"MB (lower --loss-block-size), parameter gradients {mb['parameter_grads']:,.0f} MB "
        f"(LoRA: --lora-r)" + (f", the negative queue {mb['negative_queue']:,.0f} MB (lower "
                               f"--negative-queue)" if estimate.negative_queue else ""))
