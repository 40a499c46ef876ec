"""Several training sources: parsing ``--train-data`` entries, the sampling weights (a
statistical test over many steps), every global batch from one source on every rank (2
gloo processes), and each source's own position."""

from __future__ import annotations

import math
import os

import pytest

from bigbatch.data.batches import EpochBatches
from bigbatch.data.mix import (
    CappedRecords,
    MixedBatches,
    SourceSpec,
    TrainSource,
    mix_weights,
    parse_sources,
)
from bigbatch.data.records.types import TrainRecord
from bigbatch.errors import ConfigError


def records(tag: str, n: int, k: int = 0) -> list[TrainRecord]:
    return [TrainRecord(query=f"{tag} q{i}", positive=f"{tag} d{i}",
                        negatives=[f"{tag} n{i}.{j}" for j in range(k)]) for i in range(n)]


def source(name: str, n: int, batch: int = 4, k: int = 0, rank: int = 0, world: int = 1,
           seed: int = 0) -> TrainSource:
    recs = records(name, n, k)
    return TrainSource(SourceSpec(path=name, name=name, num_hard_negatives=k), recs,
                       EpochBatches(recs, batch, k, seed, rank, world))


def test_sources_from_a_path_a_comma_list_and_yaml_mappings(tmp_path):
    assert [s.name for s in parse_sources("a/x.jsonl, b/scifact")] == ["x", "scifact"]
    specs = parse_sources([str(tmp_path / "x.jsonl"),
                           {"path": "y.jsonl", "name": "titles", "weight": 2,
                            "document_instruction": "Passage: ", "num_hard_negatives": 0,
                            "in_batch_negatives": False, "max_records": 10}], base=tmp_path)
    assert specs[1] == SourceSpec(path=str(tmp_path / "y.jsonl"), name="titles", weight=2.0,
                                  doc_instruction="Passage: ", num_hard_negatives=0,
                                  in_batch_negatives=False, max_records=10)
    assert specs[0].in_batch_negatives and specs[0].weight is None


@pytest.mark.parametrize("value, message", [
    ([{"path": "a", "wieght": 2}], "unknown key 'wieght'; did you mean 'weight'"),
    ([{"name": "a"}], "needs a 'path'"),
    (["d/train.jsonl", "e/train.jsonl"], "two sources are named 'train'"),
    ([{"path": "a", "weight": -1}], r"\[0\].weight: weight must be a number > 0"),
    ([{"path": "a", "in_batch_negatives": "no"}], "true or false"),
    ([{"path": "a", "max_records": 0}], "max_records must be an integer >= 1"),
    ([3], "expected a path or a mapping"),
])
def test_a_bad_source_entry_is_named(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_sources(value)


def test_weights_given_or_a_temperature_over_sizes():
    a, b = SourceSpec("a", "a"), SourceSpec("b", "b")
    assert mix_weights([a, b], [300, 100]) == [0.75, 0.25]
    uniformish = mix_weights([a, b], [300, 100], temperature=1e6)
    assert abs(uniformish[0] - 0.5) < 1e-4
    sqrt = mix_weights([a, b], [400, 100], temperature=2.0)
    assert sqrt == pytest.approx([2 / 3, 1 / 3])
    assert mix_weights([SourceSpec("a", "a", weight=1), SourceSpec("b", "b", weight=3)],
                       [1, 1000]) == [0.25, 0.75]
    with pytest.raises(ConfigError, match=r"not for \['b'\]"):
        mix_weights([SourceSpec("a", "a", weight=1), b], [1, 1])


def test_the_sources_are_drawn_by_weight_over_many_steps():
    """A chi-square test (fixed seed) that the schedule draws each source with its weight;
    a schedule ignoring the weights (uniform) fails it by far."""
    weights = [0.6, 0.3, 0.1]
    mixed = MixedBatches([source("a", 40), source("b", 40), source("c", 40)], weights, seed=11)
    steps = 6000
    counts = [0, 0, 0]
    for _, (i, batch) in zip(range(steps), mixed.iterate(0, mixed.start_positions())):
        counts[i] += 1
        assert batch.source == mixed.sources[i].name
    chi2 = sum((c - steps * w) ** 2 / (steps * w) for c, w in zip(counts, weights))
    assert chi2 < 13.8, (counts, chi2)  # the 0.999 quantile, 2 degrees of freedom
    uniform = sum((steps / 3 - steps * w) ** 2 / (steps * w) for w in weights)
    assert uniform > 1000  # the test can fail: equal draws are far outside it
    # the schedule depends on (seed, step) only: a start at step 100 draws the same sources
    again = [i for _, (i, _) in zip(range(50), mixed.iterate(100, mixed.start_positions()))]
    first = [mixed.source_of(s) for s in range(100, 150)]
    assert again == first


def test_each_source_keeps_its_own_position_and_epochs():
    a, b = source("a", 8, batch=4), source("b", 12, batch=4)  # 2 and 3 batches an epoch
    mixed = MixedBatches([a, b], [0.5, 0.5], seed=3)
    seen = {"a": [], "b": []}
    for _, (_, batch) in zip(range(40), mixed.iterate(0, mixed.start_positions())):
        seen[batch.source].append((batch.epoch, batch.index))
        assert all(q.startswith(batch.source) for q in batch.queries)
    for name, per_epoch in (("a", 2), ("b", 3)):
        want = [(e, i) for e in range(40) for i in range(per_epoch)][:len(seen[name])]
        assert seen[name] == want
    # resuming from positions taken after step 17 continues exactly
    positions = mixed.start_positions()
    straight = list(zip(range(30), mixed.iterate(0, positions)))
    for _, (_, batch) in straight[:17]:
        positions[batch.source] = [batch.epoch, batch.index + 1]
    resumed = [b for _, (_, b) in zip(range(13), mixed.iterate(17, positions))]
    assert [(b.source, b.epoch, b.index, b.queries) for b in resumed] == \
        [(b.source, b.epoch, b.index, b.queries) for _, (_, b) in straight[17:]]


def test_a_record_cap_is_a_view_of_the_first_records():
    recs = records("a", 10)
    capped = CappedRecords(recs, 4)
    assert len(capped) == 4 and capped[3] is recs[3] and capped[-1] is recs[3]
    assert capped[1:3] == recs[1:3]
    with pytest.raises(IndexError):
        capped[4]
    assert len(CappedRecords(recs, 50)) == 10


def test_hard_negative_counts_differ_between_sources():
    mixed = MixedBatches([source("a", 8, k=2), source("b", 8, k=0)], [0.5, 0.5], seed=0)
    sizes = {(b.source, len(b.docs) // len(b.queries))
             for _, (_, b) in zip(range(20), mixed.iterate(0, mixed.start_positions()))}
    assert sizes == {("a", 3), ("b", 1)}


def _rank_batches_case():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mixed = MixedBatches([source("a", 24, batch=2, k=1, rank=rank, world=world, seed=5),
                          source("b", 40, batch=2, rank=rank, world=world, seed=5)],
                         [0.4, 0.6], seed=5)
    mine = [(b.source, b.queries, len(b.docs))
            for _, (_, b) in zip(range(30), mixed.iterate(0, mixed.start_positions()))]
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {"steps": every}


def _worker(rank, world, port, out_path):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dist_helpers import run_cases
    run_cases(rank, world, port, out_path, {"batches": _rank_batches_case})


def test_every_global_batch_is_one_source_on_every_rank(tmp_path):
    """Two gloo processes: at each step both ranks draw the same source, their rows are
    disjoint, and together they are that source's global batch."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dist_helpers import spawn_and_collect

    per_rank = spawn_and_collect(_worker, tmp_path / "out.json")
    r0, r1 = per_rank[0]["batches"]["steps"]
    sources = set()
    for (s0, q0, n0), (s1, q1, n1) in zip(r0, r1):
        assert s0 == s1
        sources.add(s0)
        assert all(q.startswith(s0) for q in q0 + q1)
        assert not set(q0) & set(q1) and len(q0) == len(q1) == 2
        assert n0 == n1 == (4 if s0 == "a" else 2)  # source a: 1 hard negative a query
    assert sources == {"a", "b"}
    # the one-process view of the same global batch (batch 4) holds the same rows
    single = MixedBatches([source("a", 24, batch=4, k=1, seed=5),
                           source("b", 40, batch=4, seed=5)], [0.4, 0.6], seed=5)
    for (s0, q0, _), (s1, q1, _), (_, (_, b)) in zip(r0, r1, zip(range(30), single.iterate(
            0, single.start_positions()))):
        assert b.source == s0 and b.queries == q0 + q1
    assert math.isclose(sum(single.weights), 1.0)
