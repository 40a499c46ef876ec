"""InfoNCE and LogitScale against direct formulas (cross-entropy written out by hand)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import bigbatch as bb
from bigbatch.errors import ConfigError, ShapeError
from bigbatch.losses import hard_negative_count

DT = torch.float64


def embeddings(b, k, dim=8):
    q = F.normalize(torch.randn(b, dim, dtype=DT), dim=-1)
    d = F.normalize(torch.randn(b * (1 + k), dim, dtype=DT), dim=-1)
    return q, d


def direct_loss(q, d, scale, k, symmetric=False, mask=None):
    """The formula of the module docstring, with torch's cross_entropy."""
    logits = scale * q @ d.T
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    labels = torch.arange(q.shape[0]) * (1 + k)
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        back = scale * d[labels] @ q.T
        loss = 0.5 * (loss + F.cross_entropy(back, torch.arange(q.shape[0])))
    return loss


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("symmetric", [False, True])
def test_matches_direct_cross_entropy(k, symmetric):
    q, d = embeddings(5, k)
    loss_fn = bb.InfoNCE(temperature=0.05, symmetric=symmetric).to(DT)
    loss, metrics = loss_fn(query=q, doc=d)
    ref = direct_loss(q, d, loss_fn.logit_scale().detach(), k, symmetric)
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert math.isclose(metrics["temperature"].item(), 0.05, rel_tol=1e-6)


def test_interleaved_layout_positive_is_i_times_1_plus_k():
    q = torch.eye(3, dtype=DT)
    d = torch.zeros(9, 3, dtype=DT)
    for i in range(3):
        d[i * 3] = q[i]                      # positives where the layout says
        d[i * 3 + 1] = -q[i]
    loss, metrics = bb.InfoNCE(temperature=0.01, learnable_temperature=False)(query=q, doc=d)
    assert metrics["accuracy"].item() == 1.0
    assert metrics["pos_sim"].item() == pytest.approx(1.0)
    assert metrics["hard_neg_sim"].item() == pytest.approx(-0.5)  # -1 and 0 for each query
    assert loss.item() < 1e-6


def test_metrics_values():
    q, d = embeddings(4, 1)
    _, m = bb.InfoNCE()(query=q, doc=d)
    sim = q @ d.T
    pos = torch.arange(4) * 2
    own = torch.zeros_like(sim, dtype=torch.bool)
    for i in range(4):
        own[i, 2 * i:2 * i + 2] = True
    is_pos = torch.zeros_like(own)
    is_pos[torch.arange(4), pos] = True
    assert m["pos_sim"].item() == pytest.approx(sim[is_pos].mean().item())
    assert m["neg_sim"].item() == pytest.approx(sim[~is_pos].mean().item())
    assert m["inbatch_neg_sim"].item() == pytest.approx(sim[~own].mean().item())
    assert m["hard_neg_sim"].item() == pytest.approx(sim[own & ~is_pos].mean().item())
    assert m["margin"].item() == pytest.approx((sim[is_pos].mean() - sim[~is_pos].mean()).item())
    acc = (sim.argmax(1) == pos).double().mean().item()
    assert m["accuracy"].item() == pytest.approx(acc)
    assert "hard_neg_sim" not in bb.InfoNCE()(query=q, doc=d[pos])[1]


def test_doc_id_masking_matches_masked_cross_entropy():
    q, d = embeddings(4, 1)
    ids = ["a", "x", "b", "a", "c", "y", "d", "b"]  # doc 3 = q0's positive, doc 7 = q1's
    fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False).to(DT)
    loss, m = fn(query=q, doc=d, doc_ids=ids)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, 3] = True
    mask[1, 7] = True
    assert torch.allclose(loss, direct_loss(q, d, fn.logit_scale(), 1, mask=mask), rtol=1e-12)
    assert m["masked"].item() == 2


def test_symmetric_id_masking_masks_queries_sharing_a_positive():
    q, d = embeddings(3, 0)
    ids = torch.tensor([7, 7, 9])  # queries 0 and 1 share their positive passage
    loss, _ = bb.InfoNCE(temperature=0.1, symmetric=True)(query=q, doc=d, doc_ids=ids)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[0, 1] = mask[1, 0] = True
    fwd = F.cross_entropy((10 * q @ d.T).masked_fill(mask, -math.inf), torch.arange(3))
    back = F.cross_entropy((10 * d @ q.T).masked_fill(mask, -math.inf), torch.arange(3))
    assert torch.allclose(loss, 0.5 * (fwd + back), rtol=1e-12)


def test_margin_rule_masks_negatives_above_positive_plus_margin():
    q, d = embeddings(6, 1)
    margin = 0.05
    loss, m = bb.InfoNCE(temperature=0.1, false_negative_margin=margin)(query=q, doc=d)
    sim = q @ d.T
    pos = torch.arange(6) * 2
    mask = sim > sim[torch.arange(6), pos][:, None] + margin
    mask[torch.arange(6), pos] = False
    assert mask.any()
    assert m["masked"].item() == mask.sum().item()
    assert torch.allclose(loss, direct_loss(q, d, 10.0, 1, mask=mask), rtol=1e-6)


@pytest.mark.parametrize("block", [1, 2, 3, 64])
@pytest.mark.parametrize("symmetric", [False, True])
def test_streamed_equals_dense_values_gradients_metrics(block, symmetric):
    q, d = embeddings(7, 2)
    ids = torch.arange(21)
    ids[4] = 0
    dense = bb.InfoNCE(symmetric=symmetric, false_negative_margin=0.3).to(DT)
    streamed = bb.InfoNCE(symmetric=symmetric, false_negative_margin=0.3, block_size=block).to(DT)
    grads = []
    for fn in (dense, streamed):
        qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
        loss, metrics = fn(query=qq, doc=dd, doc_ids=ids)
        loss.backward()
        grads.append((loss.detach(), metrics, qq.grad, dd.grad, fn.logit_scale.log_scale.grad))
    (l1, m1, gq1, gd1, gs1), (l2, m2, gq2, gd2, gs2) = grads
    assert torch.allclose(l1, l2, rtol=1e-13)
    for a, b in ((gq1, gq2), (gd1, gd2), (gs1, gs2)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-15)
    assert m1.keys() == m2.keys()
    for key in m1:
        assert torch.allclose(m1[key], m2[key], rtol=1e-12), key


def test_streaming_bounds_memory_of_saved_tensors():
    """The streamed loss keeps no (B x N) tensor for backward; the dense one does."""
    q, d = embeddings(64, 0, dim=4)
    q.requires_grad_()
    d.requires_grad_()
    sizes = {}
    for block in (0, 8, None):  # dense, streamed, streamed in automatic blocks
        saved = []

        def pack(t):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = bb.InfoNCE(block_size=block).to(DT)(query=q, doc=d)
        sizes[block] = max(saved)
        loss.backward()
    assert sizes[0] >= 64 * 64
    assert sizes[8] < 64 * 64 // 4
    assert sizes[None] < 64 * 64 // 4


def test_learnable_temperature_owns_exactly_one_parameter():
    learn = bb.InfoNCE(learnable_temperature=True)
    params = list(learn.parameters())
    assert len(params) == 1 and params[0].requires_grad
    assert params[0].item() == pytest.approx(math.log(1 / 0.07))
    assert list(bb.InfoNCE(learnable_temperature=False).parameters()) == []
    fixed = bb.InfoNCE(learnable_temperature=False, temperature=0.02)
    assert "logit_scale.log_scale" in fixed.state_dict()  # still saved with the model


def test_logit_scale_no_clamp_in_forward_and_clamp_after_step():
    scale = bb.LogitScale(temperature=0.07, max_scale=100)
    with torch.no_grad():
        scale.log_scale.fill_(6.0)          # beyond ln(100) = 4.605
    out = scale()
    assert out.item() == pytest.approx(math.exp(6.0))
    out.backward()
    assert scale.log_scale.grad.item() == pytest.approx(math.exp(6.0))  # no dead zone
    scale.clamp_()
    assert scale.log_scale.item() == pytest.approx(math.log(100))
    with torch.no_grad():
        scale.log_scale.fill_(-1.0)
    scale.clamp_()
    assert scale.log_scale.item() == 0.0
    assert scale.temperature == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [0.005, 2.0])
def test_clamp_leaves_a_fixed_temperature_alone(temperature):
    # the training loop calls clamp_() after every step: a fixed 0.005 used to become 0.01
    fn = bb.InfoNCE(temperature=temperature, learnable_temperature=False)
    fn.clamp_()
    assert fn.temperature == pytest.approx(temperature)
    corpus = bb.CorpusInfoNCE(torch.randn(3, 4), temperature=temperature,
                              learnable_temperature=False)
    assert corpus.clamp_().temperature == pytest.approx(temperature)


@pytest.mark.parametrize("temperature,bound", [(0.005, "[0.01, 1]"), (2.0, "at most 1")])
def test_learnable_temperature_outside_the_clamp_range_is_refused(temperature, bound):
    with pytest.raises(bb.errors.ConfigError, match=re.escape(bound)):
        bb.InfoNCE(temperature=temperature, learnable_temperature=True)
    with pytest.raises(bb.errors.ConfigError, match="at least 200"):
        bb.LogitScale(temperature=0.005, max_scale=100)
    assert bb.LogitScale(temperature=0.005, max_scale=200).temperature == pytest.approx(0.005)
    for edge in (0.01, 1.0):  # the bounds themselves are inside
        assert bb.LogitScale(temperature=edge).temperature == pytest.approx(edge)


def test_k_inference_and_errors():
    assert hard_negative_count(4, 4) == 0
    assert hard_negative_count(4, 12) == 2
    with pytest.raises(ShapeError, match="multiple of the query count"):
        hard_negative_count(4, 10)
    with pytest.raises(ShapeError, match="multiple of the query count"):
        bb.InfoNCE()(query=torch.randn(3, 4), doc=torch.randn(5, 4))
    with pytest.raises(ShapeError, match="2-D"):
        bb.InfoNCE()(query=torch.randn(3), doc=torch.randn(3, 4))
    with pytest.raises(ShapeError, match="dim"):
        bb.InfoNCE()(query=torch.randn(3, 4), doc=torch.randn(3, 5))
    with pytest.raises(ShapeError, match="doc_ids"):
        bb.InfoNCE()(query=torch.randn(3, 4), doc=torch.randn(3, 4), doc_ids=[1, 2])
    for bad in (-1, 2.0, True):
        with pytest.raises(ConfigError, match="block_size"):
            bb.InfoNCE(block_size=bad)
    with pytest.raises(ConfigError, match="dense=True"):
        bb.InfoNCE(block_size=4, dense=True)
    with pytest.raises(ConfigError, match="max_block_logits"):
        bb.CorpusInfoNCE(torch.randn(3, 4), max_block_logits=0)
    with pytest.raises(ConfigError, match="temperature"):
        bb.InfoNCE(temperature=0)


def test_corpus_infonce_metrics_do_not_overflow_in_float16():
    """Counts of negatives over a large corpus exceed float16's 65,504: summed in float32."""
    torch.manual_seed(0)
    common = torch.randn(8) * 3  # similar documents: similarities near 0.9, sums past 65,504
    corpus = torch.nn.functional.normalize(torch.randn(20_000, 8) + common, dim=-1)
    q = torch.nn.functional.normalize(torch.randn(8, 8) + common, dim=-1)
    target = torch.arange(8)
    full = bb.CorpusInfoNCE(corpus, temperature=0.05)(q, target)
    half = bb.CorpusInfoNCE(corpus.half(), temperature=0.05)(q.half(), target)
    for k in ("pos_sim", "neg_sim", "margin"):
        assert torch.isfinite(half.metrics[k]), k
        assert abs(float(half.metrics[k]) - float(full.metrics[k])) < 1e-2, k


def test_corpus_infonce_checks_other_positives():
    loss = bb.CorpusInfoNCE(torch.randn(5, 4))
    with pytest.raises(bb.ShapeError, match="other_positives out of range"):
        loss(torch.randn(3, 4), torch.arange(3), other_positives=torch.tensor([[0, 5]]))
    with pytest.raises(bb.ShapeError, match=r"must be \(M, 2\)"):
        loss(torch.randn(3, 4), torch.arange(3), other_positives=torch.tensor([0, 1, 2]))


def loss_and_grads(fn, q, d, **kwargs):
    """Loss, metrics and the gradients of the query, document and temperature."""
    qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
    loss, metrics = fn(query=qq, doc=dd, **kwargs)
    loss.backward()
    return loss.detach(), metrics, [qq.grad, dd.grad, fn.logit_scale.log_scale.grad]


def assert_same(got, ref):
    (l1, m1, g1), (l2, m2, g2) = got, ref
    assert torch.allclose(l1, l2, rtol=1e-13, atol=0)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-15)
    assert m1.keys() == m2.keys()
    for key in m1:
        assert torch.allclose(m1[key], m2[key], rtol=1e-12, atol=1e-15), key


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("masks", ["none", "ids", "margin"])
def test_automatic_blocks_equal_dense_in_float64(k, symmetric, masks):
    """block_size=None streams in blocks of max_block_logits // N rows (here 2 rows against
    the documents, 5 against the queries when symmetric): the same loss, gradients, metrics."""
    q, d = embeddings(9, k)
    n = d.shape[0]
    opts = {"symmetric": symmetric, "temperature": 0.1}
    kwargs = {}
    if masks == "ids":
        ids = torch.arange(n)
        ids[(1 + k) * 2] = 0          # query 2's positive is query 0's positive passage
        ids[-1] = 1 + k               # a document equal to query 1's positive
        kwargs["doc_ids"] = ids
    if masks == "margin":
        opts["false_negative_margin"] = -0.3
    dense = bb.InfoNCE(dense=True, **opts).to(DT)
    auto = bb.InfoNCE(max_block_logits=2 * n + 1, **opts).to(DT)
    got, ref = loss_and_grads(auto, q, d, **kwargs), loss_and_grads(dense, q, d, **kwargs)
    assert_same(got, ref)
    if masks != "none":
        assert ref[1]["masked"].item() > 0
    assert_same(loss_and_grads(bb.InfoNCE(block_size=0, **opts).to(DT), q, d, **kwargs), ref)


def test_corpus_automatic_blocks_equal_dense_in_float64():
    corpus = F.normalize(torch.randn(30, 8, dtype=DT), dim=-1)
    q = F.normalize(torch.randn(7, 8, dtype=DT), dim=-1)
    target = torch.tensor([0, 3, 5, 9, 3, 29, 11])
    others = torch.tensor([[0, 1], [2, 4], [6, 12], [6, 11], [3, 3]])  # last: excluded twice
    out = []
    for fn in (bb.CorpusInfoNCE(corpus, dense=True), bb.CorpusInfoNCE(corpus, max_block_logits=65)):
        fn = fn.to(DT)
        qq = q.clone().requires_grad_()
        loss, metrics = fn(qq, target, others)
        loss.backward()
        out.append((loss.detach(), metrics, [qq.grad, fn.logit_scale.log_scale.grad]))
    assert_same(out[1], out[0])
    assert out[0][1]["masked"].item() == 4  # the pair naming a positive is no exclusion


def test_automatic_block_rule():
    from bigbatch.losses import MAX_BLOCK_LOGITS, rows_per_block

    assert MAX_BLOCK_LOGITS == 2 ** 22
    for n in (1, 100, 4096, 16384, 3 * 10 ** 5):
        rows = rows_per_block(n, None)
        assert rows * n <= MAX_BLOCK_LOGITS and (rows + 1) * n > MAX_BLOCK_LOGITS
    assert rows_per_block(16384, None) == 256
    assert rows_per_block(10 ** 7, None) == 1  # one row, even when it holds more
    assert rows_per_block(50, None, max_block_logits=120) == 2
    assert rows_per_block(50, 7) == 7
    assert rows_per_block(50, 0) is None and rows_per_block(50, None, dense=True) is None


def test_automatic_blocks_bound_every_tensor_of_forward_and_backward():
    """No tensor made in the forward or backward pass (the streamed loss's custom backward
    included) holds more than max_block_logits entries; the dense loss makes B x N ones."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    q, d = embeddings(40, 2, dim=4)  # N = 120 documents: rows and columns hold <= 480
    ids = torch.arange(120)
    ids[5] = 0
    for opts, bound in (({"max_block_logits": 500}, 500), ({"dense": True}, None)):
        fn = bb.InfoNCE(symmetric=True, false_negative_margin=0.2, **opts).to(DT)
        qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
        with Largest() as mode:
            loss, _ = fn(query=qq, doc=dd, doc_ids=ids)
            loss.backward()
        if bound is None:
            assert mode.numel >= 40 * 120
        else:
            assert 0 < mode.numel <= bound
