"""Every user-caused error is raised with a message naming the option or tower, before any
gradient is written."""

from __future__ import annotations

import pytest
import torch
from helpers import DenseTower
from torch import nn

import bigbatch as bb
from bigbatch.errors import (
    BigBatchError,
    ConfigError,
    DataError,
    InputError,
    NonFiniteError,
    ShapeError,
)


def setup():
    tower = DenseTower()
    loss_fn = bb.InfoNCE()
    inputs = {"query": torch.randn(4, 12), "doc": torch.randn(8, 12)}
    return tower, loss_fn, inputs


def no_grads(*modules):
    return all(p.grad is None for m in modules for p in m.parameters())


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, {"query": 2, "doc": 0}])
def test_chunk_size_must_be_positive_integer(bad):
    tower, loss_fn, _ = setup()
    with pytest.raises(ConfigError, match="chunk_size"):
        bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=bad)


def test_chunk_size_dict_must_name_every_tower():
    tower, loss_fn, _ = setup()
    with pytest.raises(ConfigError, match="name every tower"):
        bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size={"query": 2})


def test_missing_tower_input():
    tower, loss_fn, inputs = setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match=r"missing input\(s\) for tower\(s\) \['doc'\]"):
        cache.step(query=inputs["query"])


def test_extra_input_that_is_neither_tower_nor_loss_argument():
    tower, loss_fn, inputs = setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match="'passage'.*neither towers"):
        cache.step(**inputs, passage=inputs["doc"])
    assert no_grads(tower, loss_fn)


def test_loss_that_does_not_take_a_tower_name():
    tower, loss_fn, _ = setup()
    with pytest.raises(ConfigError, match=r"does not accept the tower name\(s\) \['passage'\]"):
        bb.GradCache({"query": tower, "passage": tower}, loss_fn, chunk_size=2)


def test_tower_output_not_2d():
    _, loss_fn, inputs = setup()
    lin = nn.Linear(12, 8)
    cache = bb.GradCache({"query": lin, "doc": lambda x: lin(x).unsqueeze(1)}, loss_fn,
                         chunk_size=3)
    with pytest.raises(ShapeError, match=r"tower 'doc' returned shape \(3, 1, 8\) for chunk 0"):
        cache.step(**inputs)
    assert no_grads(lin, loss_fn)


def test_tower_output_wrong_row_count():
    _, loss_fn, inputs = setup()
    lin = nn.Linear(12, 8)
    cache = bb.GradCache({"query": lambda x: lin(x)[:1], "doc": lin}, loss_fn, chunk_size=3)
    with pytest.raises(ShapeError, match=r"tower 'query' .* of 3 rows; expected \(3, dim\)"):
        cache.step(**inputs)
    assert no_grads(lin, loss_fn)


def test_tower_output_width_changes_between_chunks():
    _, loss_fn, inputs = setup()
    lin = nn.Linear(12, 8)
    cache = bb.GradCache({"query": lin, "doc": lambda x: lin(x)[:, :8 if x.shape[0] == 3 else 5]},
                         loss_fn, chunk_size=3)
    with pytest.raises(ShapeError, match=r"tower 'doc' returned width 5 for chunk 2 but 8 for "
                                         r"chunk 0"):
        cache.step(**inputs)
    assert no_grads(lin, loss_fn)


def test_tower_output_not_a_tensor():
    _, loss_fn, inputs = setup()
    lin = nn.Linear(12, 8)
    cache = bb.GradCache({"query": lambda x: {"emb": lin(x)}, "doc": lin}, loss_fn, chunk_size=3)
    with pytest.raises(ShapeError, match="tower 'query' returned dict"):
        cache.step(**inputs)


def test_documents_not_a_multiple_of_queries():
    tower, loss_fn, _ = setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(ShapeError, match="10 documents for 4 queries"):
        cache.step(query=torch.randn(4, 12), doc=torch.randn(10, 12))
    assert no_grads(tower, loss_fn)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_embeddings_name_the_tower(value):
    _, loss_fn, inputs = setup()
    lin = nn.Linear(12, 8)

    def bad_doc(x):
        y = lin(x)
        return torch.where(torch.arange(len(y))[:, None] == 1, torch.full_like(y, value), y)

    cache = bb.GradCache({"query": lin, "doc": bad_doc}, loss_fn, chunk_size=3)
    with pytest.raises(NonFiniteError, match="tower 'doc' produced NaN or inf"):
        cache.step(**inputs)
    assert no_grads(lin, loss_fn)


def test_non_finite_loss():
    lin = nn.Linear(12, 8)
    cache = bb.GradCache({"query": lin}, lambda query: query.sum() * float("inf"), chunk_size=3)
    with pytest.raises(NonFiniteError, match="the loss is NaN or inf"):
        cache.step(query=torch.randn(4, 12))
    assert no_grads(lin)


def test_raw_examples_without_collate_fn():
    tower, loss_fn, _ = setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match="no collate_fn"):
        cache.step(query=["a", "b"], doc=["c", "d"])


def test_dict_with_mismatched_batch_sizes():
    tower, loss_fn, _ = setup()
    cache = bb.GradCache({"query": lambda **kw: kw["x"], "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match="different batch sizes"):
        cache.step(query={"x": torch.randn(4, 8), "y": torch.randn(3, 8)}, doc=torch.randn(4, 12))


def test_empty_input_and_bad_towers():
    tower, loss_fn, _ = setup()
    with pytest.raises(ConfigError, match="non-empty dict"):
        bb.GradCache({}, loss_fn, chunk_size=2)
    with pytest.raises(ConfigError, match="not callable"):
        bb.GradCache({"query": 3, "doc": tower}, loss_fn, chunk_size=2)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match="no rows"):
        cache.step(query=torch.randn(0, 12), doc=torch.randn(0, 12))


def test_error_hierarchy_and_data_error_message():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, BigBatchError)
    assert issubclass(NonFiniteError, FloatingPointError)
    err = DataError("empty text", path="train.jsonl", line=7, field="query")
    assert str(err) == "train.jsonl:7, field 'query': empty text"
    assert (err.path, err.line, err.field) == ("train.jsonl", 7, "query")
