"""A queue of earlier steps' documents as extra negatives (``queued`` of InfoNCE, the
engine's ``keep_embeddings``, :class:`bigbatch.losses.queue.NegativeQueue`): the loss
against the objective written out by hand (queued embeddings as constants, a queued
positive masked by id and by query), and the cached step over several steps, with an
optimizer moving the weights, against an unchunked float64 reference with dropout on."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import DT, TokenTower, grads_of, max_rel_err, token_batch, trimmed_chunks, zero_grads
from objectives_helpers import cut, normalized, queue_objective

import bigbatch as bb
from bigbatch.errors import ConfigError, InputError, ShapeError
from bigbatch.losses.queue import NegativeQueue, QueuedDocs
from bigbatch.train.checkpoint import safe_load

TOL = 1e-10
CHUNK = 3


def small_case(gen):
    """3 queries with k = 1 and 5 queued documents: queued 0 has query 1's positive's id,
    queued 2 was the positive of query 2's query (another relevant document of it)."""
    q, d, queue = normalized(3, 6, gen), normalized(6, 6, gen), normalized(5, 6, gen)
    doc_ids = ["a", "b", "c", "d", "e", "a"]  # doc 5 (a negative of query 2) is query 0's pos
    queued = QueuedDocs(queue, ["c", "x", "y", "b", "z"], [None, "q9", "q2", None, None])
    return q, d, queued, doc_ids, ["q0", "q1", "q2"]


@pytest.mark.parametrize("block,symmetric", [(None, False), (0, False), (1, True), (2, False)])
def test_loss_and_gradient_equal_the_objective_written_out(block, symmetric):
    gen = torch.Generator().manual_seed(0)
    q, d, queued, doc_ids, query_ids = small_case(gen)
    q.requires_grad_(True)
    d.requires_grad_(True)
    loss_fn = bb.InfoNCE(temperature=0.1, block_size=block, symmetric=symmetric).to(DT)
    loss, metrics = loss_fn(query=q, doc=d, doc_ids=doc_ids, queued=queued, query_ids=query_ids)
    loss.backward()
    got = {"q": q.grad.clone(), "d": d.grad.clone(), "t": loss_fn.logit_scale.log_scale.grad}
    q.grad = d.grad = None
    loss_fn.zero_grad()
    ref = queue_objective(q, d, (queued.doc, queued.ids, queued.query_ids),
                          loss_fn.logit_scale(), 1, doc_ids, query_ids, symmetric)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-12
    for name, want in (("q", q.grad), ("d", d.grad), ("t", loss_fn.logit_scale.log_scale.grad)):
        assert (got[name] - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max()), name
    # masked: doc 5 for query 0 (same id as its positive); queued 0 for query 1 (id);
    # queued 2 for query 2 (its query's positive); queued 3 for query 0 ("b" is doc 1, not
    # query 0's positive: kept)
    assert metrics["masked"].item() == 3 and metrics["queued"].item() == 5
    # the queue changed the loss (not silently dropped)
    plain, _ = loss_fn(query=q, doc=d, doc_ids=doc_ids)
    assert abs(plain.item() - loss.item()) > 1e-3


def test_queued_ids_as_tensors_and_no_ids():
    gen = torch.Generator().manual_seed(1)
    q, d, queued, doc_ids, query_ids = small_case(gen)
    loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
    codes = {x: i for i, x in enumerate(dict.fromkeys(doc_ids + queued.ids))}
    owners = {"q0": 0, "q1": 1, "q2": 2, "q9": 9}
    as_tensors = QueuedDocs(queued.doc, torch.tensor([codes[x] for x in queued.ids]),
                            torch.tensor([-1 if o is None else owners[o]
                                          for o in queued.query_ids]))
    a, _ = loss_fn(query=q, doc=d, doc_ids=doc_ids, queued=queued, query_ids=query_ids)
    b, _ = loss_fn(query=q, doc=d, doc_ids=torch.tensor([codes[x] for x in doc_ids]),
                   queued=as_tensors, query_ids=torch.tensor([0, 1, 2]))
    assert abs(a.item() - b.item()) <= 1e-13
    # without any ids nothing of the queue is masked
    bare, metrics = loss_fn(query=q, doc=d, queued=QueuedDocs(queued.doc))
    ref = queue_objective(q, d, (queued.doc, [None] * 5, [None] * 5), loss_fn.logit_scale(), 1,
                          list(range(6)), [0, 1, 2])
    assert abs(bare.item() - ref.item()) <= 1e-12 and metrics["masked"].item() == 0


def test_matryoshka_truncates_the_queued_documents_too():
    gen = torch.Generator().manual_seed(2)
    q, d, queued, doc_ids, query_ids = small_case(gen)
    inner = bb.InfoNCE(temperature=0.1).to(DT)
    loss_fn = bb.Matryoshka(inner, dims=[6, 3])
    got, metrics = loss_fn(query=q, doc=d, doc_ids=doc_ids, queued=queued, query_ids=query_ids)
    want = sum(queue_objective(cut(q, m), cut(d, m), (cut(queued.doc, m), queued.ids,
                                                      queued.query_ids),
                               inner.logit_scale(), 1, doc_ids, query_ids) for m in (6, 3))
    assert abs(got.item() - want.item()) <= 1e-12 and metrics["queued@3"].item() == 5


def test_what_a_queue_cannot_go_with_is_refused_clearly():
    gen = torch.Generator().manual_seed(3)
    q, d, queued, doc_ids, query_ids = small_case(gen)
    with pytest.raises(ConfigError, match="extra_negatives"):
        bb.InfoNCE(extra_negatives="qq")(query=q, doc=d, queued=queued)
    no_in_batch = bb.InfoNCE(in_batch_negatives=False)
    with pytest.raises(ConfigError, match="in_batch_negatives=False"):
        no_in_batch(query=q, doc=d, queued=queued)
    with pytest.raises(ConfigError, match="guide"):
        bb.InfoNCE()(query=q, doc=d, queued=queued, guide_query=q, guide_doc=d)
    with pytest.raises(ShapeError, match=r"\(rows, 6\)"):
        bb.InfoNCE()(query=q, doc=d, queued=QueuedDocs(queued.doc[:, :4]))
    with pytest.raises(ShapeError, match="queued ids has 2 entries"):
        bb.InfoNCE()(query=q, doc=d, queued=QueuedDocs(queued.doc, ["a", "b"]))
    with pytest.raises(InputError, match="one kind"):
        bb.InfoNCE()(query=q, doc=d, doc_ids=torch.arange(6), queued=queued)
    with pytest.raises(InputError, match="QueuedDocs"):
        bb.InfoNCE()(query=q, doc=d, queued=queued.doc)


def test_the_queue_keeps_the_last_steps_and_its_state_loads_weights_only(tmp_path):
    queue = NegativeQueue(2)
    assert queue.queued() is None and len(queue) == 0
    for step in range(3):
        queue.push(torch.full((step + 1, 4), float(step), dtype=DT),
                   [f"d{step}-{i}" for i in range(step + 1)],
                   [f"q{step}" if i == 0 else None for i in range(step + 1)])
    queued = queue.queued()
    assert len(queue) == 5 and queued.doc[:, 0].tolist() == [1, 1, 2, 2, 2]
    assert queued.ids == ["d1-0", "d1-1", "d2-0", "d2-1", "d2-2"]
    assert queued.query_ids == ["q1", None, "q2", None, None]
    torch.save({"state": queue.state_dict()}, tmp_path / "q.pt")
    again = NegativeQueue(2)
    again.load_state_dict(safe_load(tmp_path / "q.pt")["state"])
    back = again.queued()
    assert torch.equal(back.doc, queued.doc) and back.ids == queued.ids
    assert back.query_ids == queued.query_ids
    shorter = NegativeQueue(1)  # a queue saved with more steps keeps its newest
    shorter.load_state_dict(queue.state_dict())
    assert shorter.queued().ids == ["d2-0", "d2-1", "d2-2"]
    with pytest.raises(ConfigError, match="negative queue cannot be read"):
        NegativeQueue(2).load_state_dict({"doc": [torch.zeros(2, 4)], "ids": [["a"]],
                                          "query_ids": [["", ""]]})
    with pytest.raises(ConfigError, match="at least one earlier step"):
        NegativeQueue(0)
    with pytest.raises(ConfigError, match="keep_embeddings names unknown"):
        bb.GradCache({"query": TokenTower(), "doc": TokenTower()}, bb.InfoNCE(), 2,
                     keep_embeddings=("docs",))


def step_batches(steps, b, k, gen):
    """Per step: queries, documents, document ids (strings) and query ids. Step 1's query 0
    has the id of step 0's query 1 (the same query with another positive: step 0's document
    of that positive is masked for it at step 1), and step 2's first hard negative has the
    id of step 1's query 2's positive (a queued duplicate, masked for query 0 of step 2 only
    if it is that query's positive: it is made so for query 1)."""
    out = []
    g = k + 1
    for s in range(steps):
        doc_ids = [f"s{s}d{j}" for j in range(b * g)]
        query_ids = [f"s{s}q{i}" for i in range(b)]
        out.append([token_batch(b, gen=gen), token_batch(b * g, gen=gen), doc_ids, query_ids])
    out[1][3][0] = out[0][3][1]
    out[2][2][1 * g] = out[1][2][2 * g]    # step 2's query 1's positive: queued at step 1
    out[2][2][2 * g + 1] = out[0][2][0]    # a hard negative that is queued as well
    return out


@pytest.mark.parametrize("symmetric", [False, True])
def test_cached_steps_with_a_queue_equal_the_unchunked_reference(symmetric):
    """Four steps (k = 2, queue of 2 steps, SGD between steps so the queued embeddings are
    stale): each step's gradients equal those of the objective computed directly on the
    full batch, the queue's embeddings (the reference's own, from its earlier steps) as
    constants; the engine's kept embeddings are the reference's documents."""
    k, b, steps = 2, 4, 4
    torch.manual_seed(0)
    tower = TokenTower(p=0.1).to(DT)
    ref_tower = copy.deepcopy(tower)
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=symmetric, block_size=2).to(DT)
    ref_loss_fn = copy.deepcopy(loss_fn)
    params = list(tower.parameters()) + list(loss_fn.parameters())
    ref_params = list(ref_tower.parameters()) + list(ref_loss_fn.parameters())
    opt, ref_opt = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(ref_params, lr=0.5)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=CHUNK,
                         keep_embeddings=("doc",))
    queue, ref_queue = NegativeQueue(2), []
    batches = step_batches(steps, b, k, torch.Generator().manual_seed(5))
    masked = []
    for s, (qb, db, doc_ids, query_ids) in enumerate(batches):
        owners = [query_ids[j // (k + 1)] if j % (k + 1) == 0 else None
                  for j in range(len(doc_ids))]
        zero_grads(tower, loss_fn)
        torch.manual_seed(100 + s)
        extra = {} if queue.queued() is None else {"queued": queue.queued(),
                                                   "query_ids": query_ids}
        res = cache.step(query=qb, doc=db, doc_ids=doc_ids, **extra)
        queue.push(res.embeddings["doc"], doc_ids, owners)
        got = grads_of(tower, loss_fn)

        zero_grads(ref_tower, ref_loss_fn)
        torch.manual_seed(100 + s)
        rq = torch.cat([ref_tower(**c) for c in trimmed_chunks(qb, CHUNK)])
        rd = torch.cat([ref_tower(**c) for c in trimmed_chunks(db, CHUNK)])
        kept = ref_queue[-2:]
        emb = torch.cat([e for e, _, _ in kept]) if kept else rd.new_zeros(0, rd.shape[1])
        q_ids = [i for _, ids, _ in kept for i in ids]
        q_own = [o for _, _, own in kept for o in own]
        ref = queue_objective(rq, rd, (emb, q_ids, q_own), ref_loss_fn.logit_scale(), k,
                              doc_ids, query_ids, symmetric)
        ref.backward()
        ref_queue.append((rd.detach(), doc_ids, owners))
        assert abs(res.loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
        assert max_rel_err(got, grads_of(ref_tower, ref_loss_fn)) <= TOL
        assert (res.embeddings["doc"] - rd.detach()).abs().max().item() <= 1e-13
        masked.append(res.metrics["masked"].item())
        opt.step()
        ref_opt.step()
    assert "queued" not in cache.step(query=qb, doc=db).metrics  # (no queue given: none)
    # step 1 masks step 0's positive of its query 0's query; step 2 its query 1's queued
    # positive and a queued hard negative that is query 2's own negative (not its positive:
    # a negative twice, kept)
    assert masked[0] == 0 and masked[1] == 1 and masked[2] == 1, masked
