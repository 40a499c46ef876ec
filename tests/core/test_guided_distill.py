"""Guided false-negative filtering and distillation in InfoNCE: against hand computation, and
exact under the cache (float64, dropout on) against the unchunked reference."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    DT,
    TokenTower,
    grads_of,
    max_rel_err,
    reference_step,
    token_batch,
    trimmed_chunks,
    zero_grads,
)

import bigbatch as bb
from bigbatch.errors import ConfigError, InputError, NonFiniteError, ShapeError

TOL = 1e-10


def hand_infonce(q, d, scale, masked):
    """Mean over queries of -log softmax at the positive, the (i, j) pairs in ``masked`` left
    out; k inferred; plain Python."""
    b, n = len(q), len(d)
    group = n // b
    total = 0.0
    for i in range(b):
        sims = [sum(a * c for a, c in zip(q[i], d[j])) for j in range(n)]
        pos = i * group
        lse = math.log(sum(math.exp(scale * s) for j, s in enumerate(sims)
                           if (i, j) not in masked))
        total += lse - scale * sims[pos]
    return total / b


def unit(*v):
    t = torch.tensor(v, dtype=DT)
    return (t / t.norm()).tolist()


# 2 queries, k = 2 hard negatives each: documents [pos_0, n_0_1, n_0_2, pos_1, n_1_1, n_1_2]
Q = [unit(1, 0.2, 0), unit(0, 1, 0.3)]
D = [unit(1, 0.1, 0.1), unit(0.5, 1, 0), unit(0.2, 0.3, 1),
     unit(0.1, 1, 0.2), unit(1, 1, 1), unit(0.3, -1, 0.5)]


def guide_case():
    """Guide embeddings (2 wide, another width than the model's 3) built so that the guide
    masks: for query 0 its second hard negative (doc 2) and query 1's positive (doc 3); for
    query 1 its first hard negative (doc 4) and query 0's second hard negative (doc 2).
    Nothing else exceeds the positive."""
    gq = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=DT)
    # guide similarity to query 0 is column 0, to query 1 column 1
    gd = torch.tensor([[0.50, 0.10],   # pos_0: 0.50 for q0
                       [0.20, 0.00],   # n_0_1: below
                       [0.70, 0.42],   # n_0_2: above -> masked for q0, and for q1
                       [0.60, 0.40],   # pos_1: above q0's positive -> masked for q0; 0.40 for q1
                       [0.10, 0.45],   # n_1_1: above q1's positive -> masked for q1
                       [0.00, 0.30]],  # n_1_2: below
                      dtype=DT)
    return gq, gd, {(0, 2), (0, 3), (1, 4), (1, 2)}


@pytest.mark.parametrize("block", [None, 0, 1])
def test_guided_mask_matches_hand_case_with_several_hard_negatives(block):
    gq, gd, masked = guide_case()
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, block_size=block)
    q, d = torch.tensor(Q, dtype=DT), torch.tensor(D, dtype=DT)
    loss, metrics = loss_fn(query=q, doc=d, guide_query=gq, guide_doc=gd)
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, masked)) < 1e-12
    assert metrics["guide_masked"].item() == 4
    assert metrics["masked"].item() == 4
    # not the unguided loss, nor a mask shifted by one place in the interleaved layout
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, set())) > 1e-3
    shifted = {(i, j + 1) for i, j in masked}
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, shifted)) > 1e-3


def test_guide_margins_absolute_and_relative():
    gq, gd, _ = guide_case()
    q, d = torch.tensor(Q, dtype=DT), torch.tensor(D, dtype=DT)
    # absolute 0.15: q0 masks above 0.35 (docs 2, 3); q1 masks above 0.25 (docs 2, 4, 5)
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, guide_margin=0.15)
    loss, m = loss_fn(query=q, doc=d, guide_query=gq, guide_doc=gd)
    want = {(0, 2), (0, 3), (1, 2), (1, 4), (1, 5)}
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, want)) < 1e-12
    assert m["guide_masked"].item() == 5
    # relative 0.5: q0 masks above 0.25 (docs 2, 3); q1 above 0.20 (docs 2, 4, 5)
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, guide_margin=0.5,
                         guide_margin_type="relative")
    loss, _ = loss_fn(query=q, doc=d, guide_query=gq, guide_doc=gd)
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, want)) < 1e-12
    # relative 0.2: q0 above 0.40 (docs 2, 3); q1 above 0.32 (docs 2, 4)
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, guide_margin=0.2,
                         guide_margin_type="relative")
    loss, m = loss_fn(query=q, doc=d, guide_query=gq, guide_doc=gd)
    assert abs(loss.item() - hand_infonce(Q, D, 10.0, {(0, 2), (0, 3), (1, 2), (1, 4)})) < 1e-12
    assert m["guide_masked"].item() == 4
    with pytest.raises(ConfigError, match="guide_margin_type"):
        bb.InfoNCE(guide_margin_type="percent")
    with pytest.raises(ConfigError, match="guide_margin"):
        bb.InfoNCE(guide_margin=float("nan"))


def hand_sims(i, group):
    return [sum(a * c for a, c in zip(Q[i], D[i * group + j])) for j in range(group)]


TEACHER = [[0.9, 0.3, 0.5], [0.7, 0.8, -0.2]]


def test_kl_against_hand_computation():
    tt, scale, w = 0.5, 10.0, 0.7
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, distill="kl",
                         distill_weight=w, teacher_temperature=tt)
    q, d = torch.tensor(Q, dtype=DT), torch.tensor(D, dtype=DT)
    loss, m = loss_fn(query=q, doc=d, teacher_scores=torch.tensor(TEACHER, dtype=DT))
    kl = 0.0
    for i in range(2):
        s = hand_sims(i, 3)
        zs = sum(math.exp(scale * x) for x in s)
        zt = sum(math.exp(x / tt) for x in TEACHER[i])
        for j in range(3):
            pt, ps = math.exp(TEACHER[i][j] / tt) / zt, math.exp(scale * s[j]) / zs
            kl += pt * math.log(pt / ps)
    kl /= 2
    assert abs(m["distill"].item() - kl) < 1e-12
    assert abs(loss.item() - (hand_infonce(Q, D, scale, set()) + w * kl)) < 1e-12


def test_margin_mse_against_hand_computation():
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=False, distill="margin-mse",
                         distill_weight=2.0)
    q, d = torch.tensor(Q, dtype=DT), torch.tensor(D, dtype=DT)
    loss, m = loss_fn(query=q, doc=d, teacher_scores=TEACHER)
    mse = 0.0
    for i in range(2):
        s = hand_sims(i, 3)
        t = TEACHER[i]
        mse += sum(((s[0] - s[j]) - (t[0] - t[j])) ** 2 for j in (1, 2)) / 2
    mse /= 2
    assert abs(m["distill"].item() - mse) < 1e-12
    assert abs(loss.item() - (hand_infonce(Q, D, 10.0, set()) + 2.0 * mse)) < 1e-12


def test_kl_teacher_temperature_defaults_to_the_loss_temperature():
    a = bb.InfoNCE(temperature=0.05, distill="kl")
    assert a.distillation.teacher_temperature == 0.05


def frozen_guide(width=5):
    torch.manual_seed(3)
    g = TokenTower(out=width).to(DT).eval()
    for p in g.parameters():
        p.requires_grad_(False)
    return g


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("distill", [None, "kl", "margin-mse"])
def test_exact_under_the_cache_with_guide_and_distillation(symmetric, distill):
    """float64, dropout on, chunks of 3 rows, k = 2: the cached step's gradients (model and
    temperature) equal the unchunked full-batch backward, with a guide 5 wide (the model is
    8 wide) masking negatives, and teacher scores."""
    torch.manual_seed(0)
    tower = TokenTower(p=0.1).to(DT)
    guide = frozen_guide()
    b, k = 7, 2
    gen = torch.Generator().manual_seed(5)
    q_in, d_in = token_batch(b, gen=gen), token_batch(b * (1 + k), gen=gen)
    with torch.no_grad():
        gq, gd = guide(**q_in), guide(**d_in)
    teacher = torch.randn(b, 1 + k, generator=gen, dtype=DT) if distill else None
    kwargs = dict(guide_query=gq, guide_doc=gd, guide_margin=0.05)
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=symmetric, block_size=2,
                         guide_margin=kwargs.pop("guide_margin"), distill=distill,
                         distill_weight=0.5, teacher_temperature=0.2).to(DT)
    if distill:
        kwargs["teacher_scores"] = teacher
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    torch.manual_seed(42)
    res = cache.step(query=q_in, doc=d_in, **kwargs)
    got = grads_of(tower, loss_fn)
    assert res.metrics["guide_masked"].item() > 0  # the guide did mask something
    zero_grads(tower, loss_fn)
    loss_fn.block_size, loss_fn.dense = None, True
    torch.manual_seed(42)
    ref = reference_step({"query": tower, "doc": tower}, loss_fn, {},
                         {"query": trimmed_chunks(q_in, 3), "doc": trimmed_chunks(d_in, 3)},
                         **kwargs)
    err = max_rel_err(got, grads_of(tower, loss_fn))
    assert err <= TOL, err
    assert abs(res.loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    # the guide was never replayed or trained
    assert all(p.grad is None for p in guide.parameters())


def test_bad_teacher_scores_raise_before_any_gradient():
    tower = TokenTower(p=0.1).to(DT)
    loss_fn = bb.InfoNCE(distill="kl").to(DT)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    gen = torch.Generator().manual_seed(1)
    q_in, d_in = token_batch(4, gen=gen), token_batch(12, gen=gen)
    cases = [(torch.zeros(4, 2, dtype=DT), ShapeError, r"teacher_scores must be \(4, 3\)"),
             (torch.tensor([[0.0, 1.0, float("nan")]] * 4, dtype=DT), NonFiniteError, "NaN"),
             (None, InputError, "needs teacher_scores")]
    for scores, error, text in cases:
        kwargs = {} if scores is None else {"teacher_scores": scores}
        with pytest.raises(error, match=text):
            cache.step(query=q_in, doc=d_in, **kwargs)
        assert all(p.grad is None for p in tower.parameters())
        assert all(p.grad is None for p in loss_fn.parameters())
    plain = bb.GradCache({"query": tower, "doc": tower}, bb.InfoNCE().to(DT), chunk_size=3)
    with pytest.raises(InputError, match="does not distil"):
        plain.step(query=q_in, doc=d_in, teacher_scores=torch.zeros(4, 3, dtype=DT))
    k0 = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    with pytest.raises(ShapeError, match="at least one hard negative"):
        k0.step(query=q_in, doc=token_batch(4, gen=gen), teacher_scores=torch.zeros(4, 1))
    assert all(p.grad is None for p in tower.parameters())


def test_bad_guides_raise():
    loss_fn = bb.InfoNCE()
    q, d = torch.tensor(Q, dtype=DT), torch.tensor(D, dtype=DT)
    gq, gd, _ = guide_case()
    with pytest.raises(InputError, match="both guide_query and guide_doc"):
        loss_fn(query=q, doc=d, guide_query=gq)
    with pytest.raises(ShapeError, match="guide_doc must be"):
        loss_fn(query=q, doc=d, guide_query=gq, guide_doc=gd[:5])
    with pytest.raises(ShapeError, match="one space"):
        loss_fn(query=q, doc=d, guide_query=gq, guide_doc=torch.zeros(6, 3, dtype=DT))
    with pytest.raises(ConfigError, match="distill must be one of"):
        bb.InfoNCE(distill="mse")
    with pytest.raises(ConfigError, match="distill_weight"):
        bb.InfoNCE(distill="kl", distill_weight=-1.0)
    with pytest.raises(ConfigError, match="teacher_temperature"):
        bb.InfoNCE(distill="kl", teacher_temperature=0.0)


def test_length_ordered_chunks_keep_guides_and_teacher_scores_aligned():
    """The trainer orders rows by length before chunking: the guide's embeddings and the
    teacher scores stay in the original order, so the step equals the full-batch reference
    (no dropout here: ordered chunks draw other masks than the unordered reference)."""
    torch.manual_seed(0)
    tower = TokenTower(p=0.0).to(DT)
    guide = frozen_guide(width=3)
    b, k = 6, 3
    gen = torch.Generator().manual_seed(8)
    q_in, d_in = token_batch(b, gen=gen), token_batch(b * (1 + k), gen=gen)
    with torch.no_grad():
        kwargs = {"guide_query": guide(**q_in), "guide_doc": guide(**d_in),
                  "teacher_scores": torch.randn(b, 1 + k, generator=gen, dtype=DT)}
    loss_fn = bb.InfoNCE(temperature=0.1, distill="kl", guide_margin=0.02).to(DT)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=4,
                         sort_by_length=True)
    res = cache.step(query=q_in, doc=d_in, **kwargs)
    got = grads_of(tower, loss_fn)
    assert res.metrics["guide_masked"].item() > 0
    zero_grads(tower, loss_fn)
    ref = reference_step({"query": tower, "doc": tower}, loss_fn,
                         {"query": q_in, "doc": d_in}, **kwargs)
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= TOL
    assert abs(res.loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
