"""float64 gradient equality of the GradCache engine with the unchunked full-batch reference."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    DT,
    DenseTower,
    TokenTower,
    grads_of,
    max_rel_err,
    reference_step,
    token_batch,
    trimmed_chunks,
    zero_grads,
)
from torch import nn

import bigbatch as bb
from bigbatch.errors import ConfigError

B = 6
TOL = 1e-10


def make_towers(shared: bool, p: float = 0.0):
    q = TokenTower(p=p).to(DT)
    d = q if shared else TokenTower(p=p).to(DT)
    return q, d


def compare(towers, loss_fn, inputs, *, modules, engine_kwargs=None, loss_kwargs=None,
            ref_loss_fn=None):
    """Run the engine and the reference; return (max relative error, engine loss, ref loss)."""
    loss_kwargs = loss_kwargs or {}
    zero_grads(*modules, loss_fn)
    cache = bb.GradCache(towers, loss_fn, **(engine_kwargs or {"chunk_size": 2}))
    result = cache.step(**inputs, **loss_kwargs)
    got = grads_of(*modules, loss_fn)
    ref_fn = ref_loss_fn or loss_fn
    zero_grads(*modules, ref_fn)
    ref_loss = reference_step(towers, ref_fn, inputs, **loss_kwargs)
    ref = grads_of(*modules, ref_fn)  # the loss's parameters get the same key in both
    return max_rel_err(got, ref), result, ref_loss


@pytest.mark.parametrize("chunk", [1, 4, 100], ids=["chunk1", "chunk4-not-dividing", "chunk>batch"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_chunk_sizes_towers_hard_negatives(chunk, shared, k):
    q_tower, d_tower = make_towers(shared)
    loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * (1 + k), left=True)}
    modules = [q_tower] if shared else [q_tower, d_tower]
    err, result, ref_loss = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                                    modules=modules, engine_kwargs={"chunk_size": chunk})
    assert err <= TOL
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12, atol=0)
    assert loss_fn.logit_scale.log_scale.grad is not None


@pytest.mark.parametrize("symmetric", [False, True])
def test_symmetric_and_learnable_temperature(symmetric):
    q_tower, d_tower = make_towers(shared=False)
    loss_fn = bb.InfoNCE(temperature=0.05, symmetric=symmetric).to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * 3)}
    zero_grads(loss_fn)
    err, _, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                        modules=[q_tower, d_tower], engine_kwargs={"chunk_size": 5})
    assert err <= TOL
    # the temperature's gradient is part of the comparison above; make sure it is real
    g = loss_fn.logit_scale.log_scale.grad
    assert g is not None and g.abs().item() > 1e-6


def test_fixed_temperature_has_no_parameter_and_exact():
    q_tower, d_tower = make_towers(shared=True)
    loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=False).to(DT)
    assert list(loss_fn.parameters()) == []
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    err, _, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs, modules=[q_tower])
    assert err <= TOL


def test_id_masking():
    q_tower, d_tower = make_towers(shared=True)
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=True).to(DT)
    k = 1
    inputs = {"query": token_batch(B), "doc": token_batch(B * (1 + k))}
    doc_ids = [f"d{i}" for i in range(B * (1 + k))]
    doc_ids[4] = "d0"      # query 2's positive is the same passage as query 0's positive
    doc_ids[3] = "d2"      # query 1's hard negative is the same passage as its positive (doc 2)
    err, result, ref = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                               modules=[q_tower], loss_kwargs={"doc_ids": doc_ids})
    assert err <= TOL
    assert result.metrics["masked"].item() > 0
    # masking changes the loss: the check above compared a real masked loss
    unmasked, _ = loss_fn(query=q_tower(**inputs["query"]), doc=d_tower(**inputs["doc"]))
    assert abs(unmasked.item() - ref.item()) > 1e-6


def test_margin_false_negative_masking():
    q_tower, d_tower = make_towers(shared=False)
    loss_fn = bb.InfoNCE(temperature=0.1, false_negative_margin=-0.2).to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    err, result, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                             modules=[q_tower, d_tower], engine_kwargs={"chunk_size": 3})
    assert err <= TOL
    assert result.metrics["masked"].item() > 0


@pytest.mark.parametrize("blocks", [{"block_size": 2}, {"max_block_logits": 40}],
                         ids=["block_size=2", "automatic"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_streamed_loss_equals_dense_reference(symmetric, blocks):
    q_tower, d_tower = make_towers(shared=False)
    streamed = bb.InfoNCE(temperature=0.1, symmetric=symmetric, **blocks).to(DT)
    dense = copy.deepcopy(streamed)
    dense.block_size, dense.dense = None, True
    inputs = {"query": token_batch(B + 1), "doc": token_batch((B + 1) * 2)}
    doc_ids = torch.arange((B + 1) * 2)
    doc_ids[5] = 0
    err, result, ref_loss = compare({"query": q_tower, "doc": d_tower}, streamed, inputs,
                                    modules=[q_tower, d_tower], ref_loss_fn=dense,
                                    loss_kwargs={"doc_ids": doc_ids})
    assert err <= TOL
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12, atol=0)
    assert streamed.logit_scale.log_scale.grad.abs().item() > 0  # compared within err above


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_dict_inputs_padding_trimmed_and_exact(left):
    q_tower, d_tower = make_towers(shared=True)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": token_batch(B, left=left), "doc": token_batch(B, left=left)}
    seen = []
    orig = q_tower.forward

    def spy(input_ids, attention_mask):
        seen.append((input_ids.shape[1], int(attention_mask.sum(1).max())))
        return orig(input_ids, attention_mask)

    q_tower.forward = spy
    err, _, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs, modules=[q_tower])
    assert err <= TOL
    engine_calls = seen[: len(seen) - 2]  # the last two calls are the reference's full batches
    assert engine_calls and all(width == longest for width, longest in engine_calls)


def test_length_ordered_chunking_equals_unordered_and_reference():
    q_tower, d_tower = make_towers(shared=False)
    loss_fn = bb.InfoNCE(symmetric=True).to(DT)
    inputs = {"query": token_batch(9), "doc": token_batch(18)}
    err, sorted_result, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                                    modules=[q_tower, d_tower],
                                    engine_kwargs={"chunk_size": 4, "sort_by_length": True})
    assert err <= TOL
    zero_grads(q_tower, d_tower, loss_fn)
    bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=4,
                 sort_by_length=True).step(**inputs)
    sorted_grads = grads_of(q_tower, d_tower, loss_fn)
    zero_grads(q_tower, d_tower, loss_fn)
    plain = bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=4).step(**inputs)
    assert max_rel_err(sorted_grads, grads_of(q_tower, d_tower, loss_fn)) <= 1e-12
    assert torch.allclose(sorted_result.loss, plain.loss, rtol=1e-13, atol=0)
    for key, value in plain.metrics.items():
        assert torch.allclose(sorted_result.metrics[key], value, rtol=1e-12, atol=1e-14), key


def test_frozen_tower_embedded_once_never_replayed():
    q_tower = TokenTower().to(DT)
    d_tower = TokenTower().to(DT).requires_grad_(False)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    zero_grads(q_tower, loss_fn)
    bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=4).step(**inputs)
    assert d_tower.calls == 3 and d_tower.grad_calls == 0   # 12 docs / 4, once each, no grad
    got = grads_of(q_tower, loss_fn)
    zero_grads(q_tower, loss_fn)
    reference_step({"query": q_tower, "doc": d_tower}, loss_fn, inputs)
    assert max_rel_err(got, grads_of(q_tower, loss_fn)) <= TOL
    assert all(p.grad is None for p in d_tower.parameters())


def test_no_extra_work_one_forward_and_one_replay_per_chunk():
    q_tower, d_tower = make_towers(shared=False)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=4).step(**inputs)
    # query: 2 chunks -> 2 no-grad forwards + 2 replays
    assert (q_tower.calls, q_tower.grad_calls) == (4, 2)
    # doc: 3 chunks -> 3 forwards (the last with grad, its graph kept) + 2 replays
    assert (d_tower.calls, d_tower.grad_calls) == (5, 3)
    q_tower.calls = q_tower.grad_calls = 0
    bb.GradCache({"query": q_tower}, lambda query: query.pow(2).sum(), chunk_size=4,
                 reuse_last_chunk=False).step(query=inputs["query"])
    assert (q_tower.calls, q_tower.grad_calls) == (4, 2)


def test_plain_function_tower_over_frozen_weights():
    frozen = DenseTower().to(DT).requires_grad_(False)
    q_tower = DenseTower().to(DT)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": torch.randn(5, 12, dtype=DT), "doc": torch.randn(10, 12, dtype=DT)}
    err, _, _ = compare({"query": q_tower, "doc": lambda x: frozen(x)}, loss_fn, inputs,
                        modules=[q_tower], engine_kwargs={"chunk_size": 3})
    assert err <= TOL


def test_device_option_moves_host_chunks():
    q_tower, d_tower = DenseTower().to(DT), DenseTower().to(DT)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": torch.randn(5, 12, dtype=DT), "doc": torch.randn(10, 12, dtype=DT)}
    err, _, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                        modules=[q_tower, d_tower], engine_kwargs={"chunk_size": 3, "device": "cpu"})
    assert err <= TOL


def test_at_most_one_chunk_graph_alive_at_a_time():
    """Memory is that of one chunk: the kept last chunk's graph is released before any
    replay, and each replay's graph before the next one is built."""
    alive, peak = [0], [0]

    class Counting(DenseTower):
        def forward(self, x):
            y = super().forward(x)
            if torch.is_grad_enabled():
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])
                y.register_hook(lambda g: alive.__setitem__(0, alive[0] - 1))
            return y

    tower = Counting().to(DT)
    inputs = {"query": torch.randn(7, 12, dtype=DT), "doc": torch.randn(14, 12, dtype=DT)}
    bb.GradCache({"query": tower, "doc": tower}, bb.InfoNCE().to(DT), chunk_size=3).step(**inputs)
    assert alive[0] == 0 and peak[0] == 1


def test_tensor_inputs_and_per_tower_chunk_sizes():
    q_tower = DenseTower().to(DT)
    d_tower = DenseTower().to(DT)
    loss_fn = bb.InfoNCE(temperature=0.2).to(DT)
    inputs = {"query": torch.randn(7, 12, dtype=DT), "doc": torch.randn(21, 12, dtype=DT)}
    err, _, _ = compare({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                        modules=[q_tower, d_tower],
                        engine_kwargs={"chunk_size": {"query": 3, "doc": 5}})
    assert err <= TOL


def test_raw_examples_with_collate_fn():
    tower = DenseTower(inp=4).to(DT)
    loss_fn = bb.InfoNCE().to(DT)
    q_raw = [[float(i), 1.0, -float(i), 0.5] for i in range(5)]
    d_raw = [[0.3 * i, -1.0, float(i % 3), 2.0] for i in range(10)]

    def collate(rows):
        return torch.tensor(rows, dtype=DT)

    zero_grads(tower, loss_fn)
    bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3,
                 collate_fn=collate).step(query=q_raw, doc=d_raw)
    got = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)
    reference_step({"query": tower, "doc": tower}, loss_fn,
                   {"query": collate(q_raw), "doc": collate(d_raw)})
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= TOL


@pytest.mark.parametrize("reuse_last_chunk", [True, False])
def test_random_collate_fn_is_replayed_with_its_first_pass_inputs(reuse_last_chunk):
    """A collate_fn that augments at random (noise here; a random crop or token masking
    alike) must draw the same numbers when its chunk is replayed: the gradient is that of
    the loss on the inputs the cached embeddings came from (dropout on as well)."""
    tower = DenseTower(inp=4, p=0.2).to(DT)
    loss_fn = bb.InfoNCE().to(DT)
    raw = {"query": [[float(i), 1.0, -float(i), 0.5] for i in range(5)],
           "doc": [[0.3 * i, -1.0, float(i % 3), 2.0] for i in range(10)]}

    def collate(rows):
        x = torch.tensor(rows, dtype=DT)
        return x + 0.5 * torch.randn_like(x)

    zero_grads(tower, loss_fn)
    torch.manual_seed(7)
    bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3, collate_fn=collate,
                 reuse_last_chunk=reuse_last_chunk).step(**raw)
    got = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)
    torch.manual_seed(7)  # the first pass's draws, in its order: per chunk, collate then forward
    reps = {name: torch.cat([tower(collate(rows[lo:lo + 3])) for lo in range(0, len(rows), 3)])
            for name, rows in raw.items()}
    loss_fn(**reps).loss.backward()
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= TOL


class PatchTower(nn.Module):
    """Rows of features plus a varying number of 'patches' per row, all rows' patches
    concatenated on dim 0 (as a vision-language processor's pixel values): the inputs'
    first dimensions are not the batch."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.drop = nn.Dropout(p)

    def forward(self, feats, patches, patches_per_row):
        pooled = torch.stack([x.mean(0) for x in patches.split(patches_per_row.tolist())])
        return nn.functional.normalize(self.lin(self.drop(feats + pooled)), dim=-1)


class PatchCache(bb.GradCache):
    """The documented extension point: split_inputs for the patch layout."""

    def split_inputs(self, name, inputs, chunk_size):
        n = inputs["feats"].shape[0]
        starts = [0, *inputs["patches_per_row"].cumsum(0).tolist()]
        chunks, rows = [], []
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            chunks.append({"feats": inputs["feats"][lo:hi],
                           "patches": inputs["patches"][starts[lo]:starts[hi]],
                           "patches_per_row": inputs["patches_per_row"][lo:hi]})
            rows.append(hi - lo)
        return chunks, rows


def patch_batch(n):
    per = torch.randint(1, 4, (n,))
    return {"feats": torch.randn(n, 4, dtype=DT), "patches": torch.randn(int(per.sum()), 4, dtype=DT),
            "patches_per_row": per}


@pytest.mark.parametrize("sort_by_length", [False, True])
def test_split_inputs_override_for_a_layout_whose_first_dimension_is_not_the_batch(sort_by_length):
    tower = PatchTower().to(DT)
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": patch_batch(5), "doc": patch_batch(10)}
    cache = PatchCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2,
                       sort_by_length=sort_by_length)
    zero_grads(tower, loss_fn)
    torch.manual_seed(3)
    result = cache.step(**inputs)
    got = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)
    torch.manual_seed(3)  # the engine's chunks in its order: the same dropout masks
    chunked = {n: cache.split_inputs(n, x, 2)[0] for n, x in inputs.items()}
    ref_loss = reference_step({"query": tower, "doc": tower}, loss_fn, inputs, chunked=chunked)
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= TOL
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12, atol=0)


def test_split_inputs_override_must_return_one_row_count_per_chunk():
    class Bad(bb.GradCache):
        def split_inputs(self, name, inputs, chunk_size):
            return [inputs[:2], inputs[2:]], [2]

    lin = nn.Linear(4, 4).to(DT)
    with pytest.raises(bb.errors.InputError, match="one positive integer row count per chunk"):
        Bad({"query": lin, "doc": lin}, bb.InfoNCE(), chunk_size=2).step(
            query=torch.randn(4, 4, dtype=DT), doc=torch.randn(4, 4, dtype=DT))
    assert lin.weight.grad is None


def test_any_loss_user_triplet_loss():
    q_tower, d_tower = DenseTower().to(DT), DenseTower().to(DT)

    def triplet(anchor, positive, negative, margin=0.3):
        return nn.functional.triplet_margin_loss(anchor, positive, negative, margin=margin)

    inputs = {"anchor": torch.randn(6, 12, dtype=DT), "positive": torch.randn(6, 12, dtype=DT),
              "negative": torch.randn(6, 12, dtype=DT)}
    towers = {"anchor": q_tower, "positive": d_tower, "negative": d_tower}
    zero_grads(q_tower, d_tower)
    result = bb.GradCache(towers, triplet, chunk_size=4).step(**inputs, margin=0.5)
    got = grads_of(q_tower, d_tower)
    zero_grads(q_tower, d_tower)
    reps = {n: t(inputs[n]) for n, t in towers.items()}
    ref = triplet(**reps, margin=0.5)
    ref.backward()
    assert torch.allclose(result.loss, ref.detach(), rtol=1e-12)
    assert max_rel_err(got, grads_of(q_tower, d_tower)) <= TOL


def test_gradients_accumulate_onto_existing_grad():
    tower = DenseTower().to(DT)
    loss_fn = bb.InfoNCE(learnable_temperature=False).to(DT)
    inputs = {"query": torch.randn(4, 12, dtype=DT), "doc": torch.randn(8, 12, dtype=DT)}
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    zero_grads(tower)
    cache.step(**inputs)
    once = grads_of(tower)
    cache.step(**inputs)
    twice = grads_of(tower)
    assert max_rel_err(twice, {k: 2 * v for k, v in once.items()}) <= 1e-12


def test_step_under_inference_mode_is_a_clear_error():
    """inference_mode cannot be lifted from inside (unlike no_grad): say so, write nothing."""
    lin = nn.Linear(4, 4).to(DT)
    cache = bb.GradCache({"query": lin}, lambda query: query.pow(2).mean(), chunk_size=2)
    with torch.inference_mode(), pytest.raises(ConfigError, match="inference_mode"):
        cache.step(query=torch.randn(3, 4, dtype=DT))
    assert lin.weight.grad is None


def test_plain_number_metrics_become_tensors_on_the_loss_device():
    """A loss may report plain numbers (or tensors elsewhere) as metrics; they must live
    where the loss lives, or
    to_dict()'s stack fails on an accelerator ('meta' stands in for CUDA here)."""
    res = bb.StepResult(torch.tensor(1.0, device="meta"), {"n": 3, "acc": 0.5,
                                                           "cpu_tensor": torch.tensor(2.0)})
    assert [v.device.type for v in res.metrics.values()] == ["meta", "meta", "meta"]
    torch.stack([res.loss.float(), *(v.float() for v in res.metrics.values())])  # as to_dict
    lin = nn.Linear(4, 4).to(DT)
    cache = bb.GradCache({"query": lin}, lambda query: {"loss": query.pow(2).mean(), "n": 3,
                                                        "acc": 0.5}, chunk_size=2)
    out = cache.step(query=torch.randn(3, 4, dtype=DT)).to_dict()
    assert out["n"] == 3 and out["acc"] == 0.5


def test_step_under_no_grad_still_writes_the_full_batch_gradient():
    """step() called from code running under torch.no_grad() (an evaluation helper)."""
    q_tower, d_tower = make_towers(shared=False, p=0.1)
    loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B)}
    zero_grads(q_tower, d_tower, loss_fn)
    torch.manual_seed(9)
    with torch.no_grad():
        bb.GradCache({"query": q_tower, "doc": d_tower}, loss_fn, chunk_size=4).step(**inputs)
        assert not torch.is_grad_enabled()
    got = grads_of(q_tower, d_tower, loss_fn)
    zero_grads(q_tower, d_tower, loss_fn)
    torch.manual_seed(9)  # the engine's chunks in its order: the same dropout masks
    reference_step({"query": q_tower, "doc": d_tower}, loss_fn, inputs,
                   chunked={n: trimmed_chunks(x, 4) for n, x in inputs.items()})
    assert max_rel_err(got, grads_of(q_tower, d_tower, loss_fn)) <= TOL
