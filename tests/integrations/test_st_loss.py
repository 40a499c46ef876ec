"""bigbatch.integrations.sentence_transformers on one process, float64, tiny BERT: the
gradients of CachedInfoNCELoss equal sentence-transformers' MultipleNegativesRankingLoss on
the whole batch (dropout off; and dropout on, with the masks the chunks draw), the learnable
scale's gradient and clamp, id masking from the text and from a label column, gradient
accumulation through the returned loss, the loss under no_grad, and a
SentenceTransformerTrainer run whose evaluator and saving are sentence-transformers' own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")

from pipeline_helpers import tiny_bert
from st_ddp_script import make_model

from bigbatch.errors import ConfigError, InputError
from bigbatch.integrations.sentence_transformers import CachedInfoNCELoss

B = 7
ANCHORS = [f"question {i} about topic {i * 3 % 4}" for i in range(B)]
POSITIVES = [f"answer {i} " + "word " * (i % 4 + 1) for i in range(B)]
NEGATIVES = [f"other passage {i} " + "filler " * (i % 3) for i in range(B)]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("st") / "bert", dropout=0.1)


def features(model, *columns):
    return [model.preprocess(list(c)) for c in columns]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in trainable(model)]


def rel_error(got, ref) -> float:
    """Largest difference relative to the largest gradient entry (some gradients are zero in
    exact arithmetic and hold round-off only)."""
    top = max(r.abs().max().item() for r in ref)
    return max((g - r).abs().max().item() for g, r in zip(got, ref)) / top


def bigbatch_loss(model, chunk, **kw):
    loss = CachedInfoNCELoss(model, mini_batch_size=chunk, **kw).double()
    with torch.no_grad():  # float64 exactly 20, as sentence-transformers' float scale
        loss.loss.info_nce.logit_scale.log_scale.fill_(math.log(20.0))
    return loss


def mnrl(model, scale):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    return MultipleNegativesRankingLoss(model, scale=scale)


@pytest.mark.parametrize("negatives", [0, 1], ids=["pairs", "triplets"])
def test_gradients_equal_mnrl_on_the_full_batch(bert, negatives):
    model = make_model(str(bert), torch.float64).eval()  # dropout off: any chunking
    cols = [ANCHORS, POSITIVES] + [NEGATIVES] * negatives
    feats = features(model, *cols)

    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    ref_loss = mnrl(model, scale)(feats, None)
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad()

    loss = bigbatch_loss(model, chunk=3, ids="none")
    out = loss(features(model, *cols), None)
    out.backward()
    got = grads(model)
    assert out.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert rel_error(got, ref) <= 1e-10
    # the learnable scale: d/d(log s) = s * d/ds
    log_grad = loss.loss.info_nce.logit_scale.log_scale.grad.item()
    assert log_grad == pytest.approx(20.0 * scale.grad.item(), rel=1e-10)


def test_dropout_masks_are_those_of_the_chunks(bert):
    from sentence_transformers.base.losses.gradcache import _create_minibatch
    from sentence_transformers.base.losses.merged_forward import column_merging_disabled

    model = make_model(str(bert), torch.float64).train()
    cols = [ANCHORS, POSITIVES, NEGATIVES]

    # one chunk per column: the same forward passes as MNRL's, in the same order
    torch.manual_seed(5)
    with column_merging_disabled():
        ref_loss = mnrl(model, 20.0)(features(model, *cols), None)
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad()
    torch.manual_seed(5)
    out = bigbatch_loss(model, chunk=B, learnable_scale=False, ids="none")(
        features(model, *cols), None)
    out.backward()
    assert out.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert rel_error(grads(model), ref) <= 1e-10
    model.zero_grad()

    # chunks of 3: the reference embeds the same chunks, in the same order, with a full graph
    feats = features(model, *cols)
    torch.manual_seed(6)
    embs = [torch.cat([model(_create_minibatch(f, lo, lo + 3))["sentence_embedding"]
                       for lo in range(0, B, 3)]) for f in feats]
    ref_loss = mnrl(model, 20.0).compute_loss_from_embeddings(embs, None)
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad()
    torch.manual_seed(6)
    out = bigbatch_loss(model, chunk=3, learnable_scale=False, ids="none")(
        features(model, *cols), None)
    out.backward()
    assert out.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert rel_error(grads(model), ref) <= 1e-10


def masked_reference(model, feats, masked):
    """MNRL's loss with the (query, document column) pairs in ``masked`` taken out."""
    a, p, n = (torch.nn.functional.normalize(model(f)["sentence_embedding"], dim=-1)
               for f in feats)
    logits = 20.0 * a @ torch.cat([p, n]).T
    for q, d in masked:
        logits[q, d] = -torch.inf
    return torch.nn.functional.cross_entropy(logits, torch.arange(B))


@pytest.mark.parametrize("source", ["text", "labels"])
def test_false_negatives_are_masked_by_id(bert, source):
    model = make_model(str(bert), torch.float64).eval()
    negatives = list(NEGATIVES)
    labels = None
    if source == "text":
        negatives[2] = POSITIVES[0]  # query 0's positive again, as row 2's negative
        masked = [(0, B + 2)]
    else:  # ids [positive, negative] per row; row 3's negative is row 1's positive
        labels = torch.tensor([[i, 100 + i] for i in range(B)])
        labels[3, 1] = 1
        masked = [(1, B + 3)]
    cols = [ANCHORS, POSITIVES, negatives]
    ref_loss = masked_reference(model, features(model, *cols), masked)
    ref_loss.backward()
    ref = grads(model)
    model.zero_grad()
    loss = bigbatch_loss(model, chunk=3, learnable_scale=False, ids="auto")
    out = loss(features(model, *cols), labels)
    out.backward()
    assert out.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert rel_error(grads(model), ref) <= 1e-10
    unmasked = bigbatch_loss(model, chunk=3, learnable_scale=False, ids="none")
    with torch.no_grad():
        assert unmasked(features(model, *cols), labels).item() > out.item() + 1e-6


def test_gradient_accumulation_and_loss_scaling(bert):
    """Two micro-batches, each loss divided by 2 as a trainer does: the gradients are the
    mean of the two batches' gradients, the first kept while the second step runs."""
    model = make_model(str(bert), torch.float64).eval()
    halves = [(ANCHORS[:4], POSITIVES[:4]), (ANCHORS[3:], POSITIVES[3:])]
    for cols in halves:
        (mnrl(model, 20.0)(features(model, *cols), None) / 2).backward()
    ref = grads(model)
    model.zero_grad()
    loss = bigbatch_loss(model, chunk=2, learnable_scale=False, ids="none")
    for cols in halves:
        (loss(features(model, *cols), None) / 2).backward()
    assert rel_error(grads(model), ref) <= 1e-10


def test_clamp_and_evaluation_loss(bert):
    model = make_model(str(bert), torch.float64).eval()
    loss = bigbatch_loss(model, chunk=3, ids="none")
    with torch.no_grad():
        loss.loss.info_nce.logit_scale.log_scale.fill_(math.log(500.0))
        evaluated = loss(features(model, ANCHORS, POSITIVES), None)  # no step, no clamp
        expected = mnrl(model, 500.0)(features(model, ANCHORS, POSITIVES), None)
    assert not evaluated.requires_grad
    assert evaluated.item() == pytest.approx(expected.item(), rel=1e-12)
    loss(features(model, ANCHORS, POSITIVES), None).backward()
    assert loss.scale == pytest.approx(100.0)  # clamped to max_scale before the step


def test_bad_options_and_inputs(bert):
    model = make_model(str(bert), torch.float32)
    with pytest.raises(ConfigError, match="mini_batch_size"):
        CachedInfoNCELoss(model, mini_batch_size=0)
    with pytest.raises(ConfigError, match="similarity must be one of"):
        CachedInfoNCELoss(model, similarity="euclid")
    with pytest.raises(ConfigError, match="learnable scale starts in"):
        CachedInfoNCELoss(model, scale=200.0)
    CachedInfoNCELoss(model, scale=200.0, learnable_scale=False)  # a fixed scale may be any
    loss = CachedInfoNCELoss(model, mini_batch_size=2)
    with pytest.raises(InputError, match="at least 2 columns"):
        loss(features(model, ANCHORS), None)
    with pytest.raises(InputError, match=r"ids of shape \(7,\); expected \(7, 2\)"):
        loss(features(model, ANCHORS, POSITIVES, NEGATIVES), torch.arange(B))
    with pytest.raises(InputError, match="ids='labels' needs an integer 'label' column"):
        CachedInfoNCELoss(model, ids="labels")(features(model, ANCHORS, POSITIVES), None)


def test_sentence_transformer_trainer_evaluator_and_saving(bert, tmp_path):
    """One step inside SentenceTransformerTrainer: the loss trains, an evaluator and the
    eval loss run, and the saved folder loads with sentence-transformers."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.evaluation import TripletEvaluator

    model = make_model(str(bert), torch.float32)
    data = Dataset.from_dict({"anchor": ANCHORS, "positive": POSITIVES})  # one step
    evaluator = TripletEvaluator(ANCHORS, POSITIVES, NEGATIVES, name="tiny")
    loss = CachedInfoNCELoss(model, mini_batch_size=3)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=B, num_train_epochs=1,
        learning_rate=1e-3, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, logging_strategy="no")
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         eval_dataset=data, loss=loss, evaluator=evaluator)
    before = loss.scale
    trainer.train()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert "eval_tiny_cosine_accuracy" in metrics
    assert loss.scale != before  # the learnable scale is in the trainer's optimizer
    model.save(str(tmp_path / "saved"))
    again = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    a, b = model.encode(ANCHORS[:2]), again.encode(ANCHORS[:2])
    assert abs(a - b).max() < 1e-5
