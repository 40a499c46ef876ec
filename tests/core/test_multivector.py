"""Late interaction under the cache: towers returning TokenEmbeddings and MaxSimInfoNCE, in
float64 against an unchunked (naive, dense) reference; the MaxSim score by hand; bad inputs
refused before any gradient is written."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import DT, grads_of, max_rel_err, token_batch, zero_grads
from multivector_helpers import TokenVectors, naive_maxsim_loss, naive_scores, run_chunked
from torch import nn

import bigbatch as bb
from bigbatch.errors import ConfigError, InputError, ShapeError
from bigbatch.losses.maxsim import block_shape, maxsim_scores

B = 6
TOL = 1e-10


def towers(shared: bool = False, p: float = 0.1):
    q = TokenVectors(p=p).to(DT)
    return q, (q if shared else TokenVectors(p=p).to(DT))


def ragged_inputs(k: int, gen_seed: int = 3):
    """Queries up to 6 tokens, documents up to 12: chunks of different token counts."""
    gen = torch.Generator().manual_seed(gen_seed)
    return {"query": token_batch(B, max_len=6, gen=gen),
            "doc": token_batch(B * (1 + k), max_len=12, gen=gen)}


def engine_vs_reference(q_tower, d_tower, loss_fn, inputs, chunk, *, ref_loss_fn=None,
                        loss_kwargs=None, **engine_kwargs):
    """Engine step and the reference on the same chunks (same dropout draws) from the same
    seed; returns (max relative error, engine result, reference loss)."""
    loss_kwargs = loss_kwargs or {}
    modules = [q_tower] if q_tower is d_tower else [q_tower, d_tower]
    cache = bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=chunk,
                         **engine_kwargs)
    zero_grads(*modules, loss_fn)
    torch.manual_seed(7)
    result = cache.step(**inputs, **loss_kwargs)
    got = grads_of(*modules, loss_fn)
    ref_fn = ref_loss_fn or loss_fn
    zero_grads(*modules, ref_fn)
    torch.manual_seed(7)
    q = run_chunked(q_tower, inputs["query"], chunk)
    d = run_chunked(d_tower, inputs["doc"], chunk)
    ref_loss = naive_maxsim_loss(ref_fn, q, d, loss_kwargs.get("doc_ids"))
    ref_loss.backward()
    return max_rel_err(got, grads_of(*modules, ref_fn)), result, ref_loss.detach()


# ------------------------------------------------------------------------ the score
def test_maxsim_score_by_hand():
    # query: tokens (1, 0), (0, 1) and a masked (5, 5); doc 0: (1, 2), (3, -1), masked (100, 100)
    # q1: max(1, 3) = 3; q2: max(2, -1) = 2 -> 5. doc 1: one token (-1, 0.5): -1 + 0.5 = -0.5
    q = bb.TokenEmbeddings(torch.tensor([[[1., 0.], [0., 1.], [5., 5.]]], dtype=DT),
                           torch.tensor([[1, 1, 0]]))
    d = bb.TokenEmbeddings(torch.tensor([[[1., 2.], [3., -1.], [100., 100.]],
                                         [[-1., .5], [0., 0.], [0., 0.]]], dtype=DT),
                           torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert maxsim_scores(q, d).tolist() == [[5.0, -0.5]]
    assert maxsim_scores(q, d, normalize_query=True).tolist() == [[2.5, -0.25]]
    loss_fn = bb.MaxSimInfoNCE(temperature=1.0, learnable_temperature=False).to(DT)
    loss, metrics = loss_fn(query=q, doc=d)  # k = 1: doc 1 is the hard negative
    assert loss.item() == pytest.approx(math.log1p(math.exp(-5.5)), rel=1e-14)
    assert metrics["pos_sim"].item() == 5.0 and metrics["hard_neg_sim"].item() == -0.5
    assert metrics["accuracy"].item() == 1.0 and metrics["masked"].item() == 0.0


@pytest.mark.parametrize("block", [None, 1, (2, 3), (3, 1), 1000])
@pytest.mark.parametrize("normalize", [False, True])
def test_blockwise_scores_and_gradients_equal_the_dense_ones(block, normalize):
    gen = torch.Generator().manual_seed(0)
    qm = (torch.rand(5, 7, generator=gen) > 0.3).long()
    dm = (torch.rand(8, 9, generator=gen) > 0.5).long()
    qm[:, 0] = dm[:, 3] = 1  # no empty row; the documents' padding is not only on the right
    qv = torch.randn(5, 7, 4, dtype=DT, generator=gen)
    dv = torch.randn(8, 9, 4, dtype=DT, generator=gen)
    dv[dm == 0] = float("nan")  # a masked token's value never matters, even NaN
    grad_out = torch.randn(5, 8, dtype=DT, generator=gen)
    got, ref = [], []
    for fn, out in ((lambda q, d: maxsim_scores(q, d, normalize_query=normalize,
                                                block_size=block), got),
                    (lambda q, d: naive_scores(q, d, normalize), ref)):
        q, d = qv.clone().requires_grad_(), dv.clone().requires_grad_()
        s = fn(bb.TokenEmbeddings(q, qm), bb.TokenEmbeddings(d.nan_to_num() if out is ref
                                                              else d, dm))
        s.backward(grad_out)
        out += [s.detach(), q.grad, d.grad.nan_to_num() if out is ref else d.grad]
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() <= 1e-13 * b.abs().max().item()
    assert torch.isfinite(got[2]).all() and (got[2][dm == 0] == 0).all()


def test_block_choice_rule():
    # as many documents as fit with one query, then as many queries as fit with those
    assert block_shape(100, 1000, 32, 180, max_block_elements=32 * 180 * 50) == (1, 50)
    assert block_shape(100, 10, 32, 180, max_block_elements=32 * 180 * 10 * 4) == (4, 10)
    assert block_shape(100, 10, 32, 180, max_block_elements=1) == (1, 1)  # one pair at least
    assert block_shape(5, 7, 4, 4, block_size=3) == (3, 3)
    assert block_shape(5, 7, 4, 4, block_size=(9, 2)) == (5, 2)


def test_the_graph_keeps_no_block():
    """Saved for backward: the inputs and the B x N scores, nothing of B x N x Tq x Td."""
    gen = torch.Generator().manual_seed(1)
    q = bb.TokenEmbeddings(torch.randn(8, 10, 4, dtype=DT, generator=gen).requires_grad_(),
                           torch.ones(8, 10, dtype=torch.long))
    d = bb.TokenEmbeddings(torch.randn(16, 12, 4, dtype=DT, generator=gen).requires_grad_(),
                           torch.ones(16, 12, dtype=torch.long))
    loss_fn = bb.MaxSimInfoNCE(symmetric=True, max_block_elements=2 * 16 * 10 * 12).to(DT)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        loss, _ = loss_fn(query=q, doc=d)
    assert max(saved) <= max(q.values.numel(), d.values.numel(), 8 * 16)
    loss.backward()  # each block recomputed and freed in turn
    assert q.values.grad.abs().sum() > 0 and d.values.grad.abs().sum() > 0


def test_no_operation_allocates_anything_near_the_full_similarity_tensor():
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    q = bb.TokenEmbeddings(torch.randn(8, 16, 8, dtype=DT, generator=gen).requires_grad_(),
                           torch.ones(8, 16))
    d = bb.TokenEmbeddings(torch.randn(32, 64, 8, dtype=DT, generator=gen).requires_grad_(),
                           torch.ones(32, 64))
    full = 8 * 32 * 16 * 64 * 8  # bytes of all similarities at once: 2 MiB
    largest = {}
    for elements in (2 ** 12, 2 ** 30):
        loss_fn = bb.MaxSimInfoNCE(symmetric=True, max_block_elements=elements).to(DT)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss, _ = loss_fn(query=q, doc=d)
            loss.backward()
        largest[elements] = max(e.cpu_memory_usage for e in prof.events())
    assert largest[2 ** 30] >= full  # one block: the measure sees the whole tensor
    inputs = d.values.numel() * 8
    assert largest[2 ** 12] <= inputs + 2 * 2 ** 12 * 8 < full / 8  # a gradient, a block


# ------------------------------------------------------------- the engine, exact
@pytest.mark.parametrize("chunk", [1, 4, 100], ids=["chunk1", "chunk4-not-dividing", "chunk>batch"])
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
def test_engine_equals_unchunked_reference(chunk, k, shared):
    q_tower, d_tower = towers(shared)
    loss_fn = bb.MaxSimInfoNCE(temperature=0.1).to(DT)
    err, result, ref_loss = engine_vs_reference(q_tower, d_tower, loss_fn, ragged_inputs(k), chunk)
    assert err <= TOL
    assert abs(result.loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    assert loss_fn.logit_scale.log_scale.grad.abs().item() > 0  # compared within err above


@pytest.mark.parametrize("symmetric", [False, True])
def test_streamed_loss_equals_dense_with_ids_and_normalised_scores(symmetric):
    q_tower, d_tower = towers()
    streamed = bb.MaxSimInfoNCE(temperature=0.05, symmetric=symmetric, normalize_query=True,
                                block_size=(2, 3)).to(DT)
    dense = copy.deepcopy(streamed)
    dense.block_size = 10 ** 6
    inputs = ragged_inputs(k=1)
    doc_ids = [f"d{i}" for i in range(B * 2)]
    doc_ids[4] = "d0"  # query 2's positive is query 0's
    doc_ids[3] = "d2"  # query 1's hard negative is its own positive
    results = []
    for loss_fn in (streamed, dense):
        err, result, ref_loss = engine_vs_reference(q_tower, d_tower, loss_fn, inputs, 4,
                                                    loss_kwargs={"doc_ids": doc_ids})
        assert err <= TOL
        assert abs(result.loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
        results.append(result)
    assert results[0].metrics["masked"].item() > 0
    for name, value in results[0].metrics.items():
        assert value.item() == pytest.approx(results[1].metrics[name].item(), rel=1e-12, abs=0)


def test_automatic_small_blocks_margin_and_fixed_temperature():
    q_tower, d_tower = towers()
    loss_fn = bb.MaxSimInfoNCE(temperature=0.2, learnable_temperature=False,
                               false_negative_margin=-0.5, max_block_elements=100).to(DT)
    assert list(loss_fn.parameters()) == []
    err, result, _ = engine_vs_reference(q_tower, d_tower, loss_fn, ragged_inputs(k=2), 3)
    assert err <= TOL
    assert result.metrics["masked"].item() > 0


@pytest.mark.parametrize("options", [{"sort_by_length": True}, {"reuse_last_chunk": False},
                                     {"trim_padding": False}],
                         ids=["sorted", "no-reuse", "untrimmed"])
def test_truly_unchunked_reference_left_padded_documents(options):
    """No dropout: the reference is the whole batch through each tower at once, at the
    tokenizer's width; documents are left-padded (their leading columns are not cached)."""
    q_tower, d_tower = towers(p=0.0)
    loss_fn = bb.MaxSimInfoNCE(temperature=0.1, symmetric=True).to(DT)
    gen = torch.Generator().manual_seed(5)
    inputs = {"query": token_batch(B + 1, max_len=7, gen=gen),
              "doc": token_batch(2 * (B + 1), max_len=12, left=True, gen=gen)}
    cache = bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=3, **options)
    zero_grads(q_tower, d_tower, loss_fn)
    result = cache.step(**inputs)
    got = grads_of(q_tower, d_tower, loss_fn)
    zero_grads(q_tower, d_tower, loss_fn)
    ref_loss = naive_maxsim_loss(loss_fn, q_tower(**inputs["query"]), d_tower(**inputs["doc"]))
    ref_loss.backward()
    assert max_rel_err(got, grads_of(q_tower, d_tower, loss_fn)) <= TOL
    assert abs(result.loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())


def test_cache_is_padded_only_to_the_longest_row():
    seen = {}

    def loss_used(query, doc):
        seen.update(query=tuple(query.values.shape), doc=tuple(doc.values.shape))
        return naive_maxsim_loss(bb.MaxSimInfoNCE(), query, doc)

    loss_used.token_inputs = ("query", "doc")  # a user's own late-interaction loss
    tower = TokenVectors(p=0.0).to(DT)
    inputs = {"query": token_batch(4, max_len=10), "doc": token_batch(4, max_len=20)}
    for name in inputs:  # the tokenizer padded far beyond the longest row
        inputs[name] = {k: nn.functional.pad(v, (0, 30)) for k, v in inputs[name].items()}
    bb.GradCache({"query": tower, "doc": tower}, loss_used, chunk_size=2,
                 trim_padding=False).step(**inputs)
    longest = {n: int(x["attention_mask"].sum(1).max()) for n, x in inputs.items()}
    assert seen == {"query": (4, longest["query"], 8), "doc": (4, longest["doc"], 8)}


# ------------------------------------------------------------------ bad inputs
class Broken(nn.Module):
    """A token tower whose output is broken in one way."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inner = TokenVectors().to(DT)
        self.how = how

    def forward(self, input_ids, attention_mask):
        values, mask = self.inner(input_ids, attention_mask)
        if self.how == "mask-shape":
            return bb.TokenEmbeddings(values, nn.functional.pad(mask, (0, 1), value=1))
        if self.how == "values-2d":
            return bb.TokenEmbeddings(values.mean(1), mask)
        if self.how == "single-vector":
            return nn.functional.normalize(values.mean(1), dim=-1)
        return bb.TokenEmbeddings(values, mask)


def _all_masked_row(batch):
    batch = {k: v.clone() for k, v in batch.items()}
    batch["attention_mask"][4] = 0
    return batch


@pytest.mark.parametrize("case,error", [
    ("mask-shape", ShapeError), ("values-2d", ShapeError), ("single-vector", ShapeError),
    ("all-masked", InputError), ("all-masked-sorted", InputError), ("infonce", ShapeError),
])
def test_bad_token_outputs_raise_before_any_gradient(case, error):
    q_tower = TokenVectors().to(DT)
    d_tower = Broken(case if case in ("mask-shape", "values-2d", "single-vector") else "ok")
    loss_fn = (bb.InfoNCE() if case == "infonce" else bb.MaxSimInfoNCE()).to(DT)
    inputs = ragged_inputs(k=1)
    if case.startswith("all-masked"):
        inputs["doc"] = _all_masked_row(inputs["doc"])
    cache = bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=3,
                         sort_by_length=case.endswith("sorted"))
    zero_grads(q_tower, d_tower, loss_fn)
    with pytest.raises(error) as info:
        cache.step(**inputs)
    assert "'doc'" in str(info.value) or case == "infonce"
    if case.startswith("all-masked"):
        assert "row 4 " in str(info.value)
    params = [*q_tower.parameters(), *d_tower.parameters(), *loss_fn.parameters()]
    assert params and all(p.grad is None for p in params)


def test_loss_refuses_bad_inputs_by_itself():
    loss_fn = bb.MaxSimInfoNCE()
    q = bb.TokenEmbeddings(torch.randn(2, 3, 4), torch.ones(2, 3))
    d = bb.TokenEmbeddings(torch.randn(4, 5, 4), torch.ones(4, 5))
    with pytest.raises(ShapeError, match="must be TokenEmbeddings"):
        loss_fn(query=q, doc=torch.randn(4, 4))
    with pytest.raises(ShapeError, match="mask"):
        loss_fn(query=q, doc=bb.TokenEmbeddings(d.values, torch.ones(4, 4)))
    with pytest.raises(ShapeError, match="same space"):
        loss_fn(query=q, doc=bb.TokenEmbeddings(torch.randn(4, 5, 3), d.mask))
    with pytest.raises(InputError, match="doc row 1 has every token masked"):
        mask = d.mask.clone()
        mask[1] = 0
        loss_fn(query=q, doc=bb.TokenEmbeddings(d.values, mask))
    with pytest.raises(ShapeError, match="multiple of the query count"):
        loss_fn(query=q, doc=bb.TokenEmbeddings(d.values[:3], d.mask[:3]))
    for bad in (0, (2, 0), (1, 2, 3), [4], 1.5, True):
        with pytest.raises(ConfigError, match="block_size"):
            bb.MaxSimInfoNCE(block_size=bad)
