"""``bigbatch train --refresh-negatives-every``: hard negatives mined again during training
(tiny BERT, a 64-pair SciFact slice). A resume across a refresh equals the run that never
stopped, bit for bit; the negatives after a refresh are what ``bigbatch mine`` gives for the
same weights, and never a known positive; records without negatives (a BEIR folder, pairs)
train in one command; two gloo ranks mine what one process mines; bad values are refused
before step 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.data.records.loader import load_records
from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train
from bigbatch.train.checkpoint import latest_checkpoint, saved_state


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


def config(assets, out, **kw):
    tiny, data = assets
    # full fine-tuning at a high rate: the weights move enough in a few steps that the
    # negatives mined after them differ from the starting model's
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=4, max_steps=6, warmup_steps=1, save_steps=3, eval_steps=0,
                eval_at_start=False, lora_r=0, lr=1e-2, max_length=48, seed=3,
                save_total_limit=10, num_hard_negatives=2, refresh_negatives_every=2,
                negatives_max_score_ratio=0.0, report_to=["none"])
    base.update(kw)
    return TrainConfig(**base)


def rows(out, kind):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def negatives_of(ckpt):
    """Each record's negative ids as the checkpoint keeps them, and the step they were mined
    after."""
    saved = saved_state(ckpt)["negatives"]
    names = saved["ids"]
    return [[names[j] for j in row] for row in saved["table"].tolist()], saved["mined_at"]


@pytest.mark.parametrize("stop, saves", [(3, 2), (4, 3)])
def test_resume_across_a_refresh_equals_the_run_that_never_stopped(assets, tmp_path, stop, saves):
    """(3, 2): resumed at step 2, where a refresh is due (mined again, with the checkpoint's
    weights); (4, 3): resumed at step 3 with the negatives mined after step 2 (read from the
    checkpoint), the next refresh after step 4 done by the resumed run."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(config(assets, a, save_steps=saves))
    stopped = train(config(assets, b, save_steps=saves), on_step_end=lambda s, _: s >= stop)
    assert stopped["stopped"]
    assert latest_checkpoint(b).name == f"checkpoint-{saves:06d}"
    train(config(assets, b, save_steps=saves, resume=str(b)))
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k  # bit for bit
    ra, rb = rows(a, "refresh"), rows(b, "refresh")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 3, 5]
    assert [r["negatives_changed"] for r in ra] == [r["negatives_changed"] for r in rb]
    assert ra[0]["negatives_changed"] == ra[0]["negatives"] == 64 * 2  # mined from none
    assert sum(r["negatives_changed"] for r in ra[1:]) > 0  # the model moved its negatives
    assert [r["loss"] for r in rows(a, "train")] == [r["loss"] for r in rows(b, "train")]
    assert negatives_of(a / "checkpoint-000006") == negatives_of(b / "checkpoint-000006")


def test_refreshed_negatives_are_what_mine_gives_and_never_a_positive(assets, tmp_path, capsys):
    """The false-negative rule on (a tiny random model scores many documents near the
    positive: a ratio of 0.999 over the whole pool; a pair left short, which mine does not
    write, is completed at random)."""
    tiny, data = assets
    out = tmp_path / "run"
    mining = dict(negatives_max_score_ratio=0.999, negatives_rank_window="0:150")
    # checkpoint-2 holds the weights the refresh after step 2 mined with, checkpoint-4 the
    # negatives it mined (a checkpoint is written before the refresh that follows its step)
    train(config(assets, out, max_steps=4, save_steps=2, **mining))
    printed = capsys.readouterr().out
    assert "hard negatives mined before step 1" in printed
    assert "hard negatives mined after step 2" in printed and "steps' time" in printed
    negs, mined_at = negatives_of(out / "checkpoint-000004")
    assert mined_at == 2
    mined = tmp_path / "mined.jsonl"
    assert main(["mine", "--model", str(out / "checkpoint-000002" / "model"), "--data",
                 str(data), "--output", str(mined), "--num-negatives", "2", "--rank-window",
                 "0:150", "--max-score-ratio", "0.999", "--no-cache"]) == 0
    by_pair = {(r["query_id"], r["positive_id"]): r["negative_ids"]
               for r in map(json.loads, mined.read_text().splitlines())}
    records = load_records(data)  # the training records, in training's order
    assert len(records) == len(negs) == 64
    written = [(r, n) for r, n in zip(records, negs) if (r.query_id, r.positive_id) in by_pair]
    assert len(written) >= 60
    assert all(by_pair[(r.query_id, r.positive_id)] == n for r, n in written)
    assert rows(out, "refresh")[1]["pairs_short"] == 64 - len(written)
    report = json.loads(Path(f"{mined}.report.json").read_text())
    assert report["dropped_as_false_negative"] > 0  # the rule was at work
    positives: dict[str, set[str]] = {}
    for r in records:
        positives.setdefault(r.query_id, set()).add(r.positive_id)
    assert all(not set(n) & positives[r.query_id] for r, n in zip(records, negs))
    assert all(len(set(n)) == len(n) == 2 for n in negs)


def test_a_multivector_model_refreshes_by_maxsim_as_mine_does(assets, tmp_path):
    """--pooling multivector: the negatives mined after step 2 (MaxSim against the pool's
    token store) are what ``bigbatch mine`` gives with the checkpoint's model folder."""
    tiny, data = assets
    out = tmp_path / "run"
    train(config(assets, out, max_steps=4, save_steps=2, pooling="multivector",
                 multivector_dim=16))
    negs, mined_at = negatives_of(out / "checkpoint-000004")
    assert mined_at == 2
    mined = tmp_path / "mined.jsonl"
    assert main(["mine", "--model", str(out / "checkpoint-000002" / "model"), "--data",
                 str(data), "--output", str(mined), "--num-negatives", "2",
                 "--max-score-ratio", "0", "--no-cache"]) == 0
    by_pair = {(r["query_id"], r["positive_id"]): r["negative_ids"]
               for r in map(json.loads, mined.read_text().splitlines())}
    records = load_records(data)
    assert len(by_pair) == len(records) == len(negs) == 64
    assert all(by_pair[(r.query_id, r.positive_id)] == n for r, n in zip(records, negs))
    assert sum(r["negatives_changed"] for r in rows(out, "refresh")[1:]) > 0


def test_pairs_without_negatives_train_in_one_command(assets, tmp_path, capsys):
    """A JSONL of (query, positive) pairs: the pool is the records' own documents, written
    to a temporary corpus (the data file is left as it was)."""
    tiny, data = assets
    pairs = tmp_path / "pairs.jsonl"
    records = load_records(data)
    pairs.write_text("".join(json.dumps({"query": r.query, "positive": r.positive}) + "\n"
                             for r in records))
    before = pairs.read_bytes()
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny), "--train-data", str(pairs), "--output-dir",
                 str(out), "--batch-size", "8", "--grad-cache-chunk", "4", "--max-steps", "3",
                 "--warmup-steps", "1", "--lora-r", "0", "--max-length", "48",
                 "--no-eval-at-start", "--num-hard-negatives", "3",
                 "--refresh-negatives-every", "epoch", "--negatives-max-score-ratio", "0",
                 "--report-to", "none"]) == 0
    assert "hard negatives mined before step 1" in capsys.readouterr().out
    assert pairs.read_bytes() == before
    negs, mined_at = negatives_of(out / "checkpoint-000003")
    assert mined_at == 0 and len(negs) == len(records)
    texts = {r.positive_id: r.positive for r in load_records(pairs)}
    # each negative is another pair's positive, never the record's own
    for r, n in zip(load_records(pairs), negs):
        assert r.positive_id not in n and all(d in texts for d in n)


def test_pairs_mine_from_a_negatives_corpus_which_must_hold_their_positives(assets, tmp_path):
    tiny, data = assets
    records = load_records(data)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": r.query, "positive": r.positive}) + "\n"
                             for r in records))
    out = tmp_path / "run"
    train(config(assets, out, train_data=str(pairs), negatives_corpus=str(data), max_steps=1))
    negs, _ = negatives_of(out / "checkpoint-000001")
    corpus_ids = {json.loads(l)["_id"] for l in (data / "corpus.jsonl").read_text().splitlines()}
    positives = {r.positive_id for r in records}
    assert all(set(n) <= corpus_ids for n in negs)
    assert any(set(n) - positives for n in negs)  # documents no pair holds: the corpus's own
    pairs.write_text(pairs.read_text() + json.dumps({"query": "q", "positive": "nowhere"}) + "\n")
    with pytest.raises(ConfigError, match="1 training record.* no document of"):
        train(config(assets, tmp_path / "other", train_data=str(pairs),
                     negatives_corpus=str(data)))
    assert not (tmp_path / "other").exists()


def test_a_beir_folder_without_negatives_trains_from_the_command_line(assets, tmp_path,
                                                                    capsys):
    """Without the option, the same command is refused (a BEIR folder has no negatives);
    with it, the folder is mined before step 1 and trains."""
    tiny, data = assets
    args = ["train", "--model", str(tiny), "--train-data", str(data), "--batch-size", "8",
            "--grad-cache-chunk", "4", "--max-steps", "2", "--warmup-steps", "1",
            "--max-length", "48", "--no-eval-at-start", "--num-hard-negatives", "2",
            "--report-to", "none", "--negatives-max-score-ratio", "0"]
    assert main([*args, "--output-dir", str(tmp_path / "no")]) != 0
    assert "has no hard negatives" in capsys.readouterr().err
    assert main([*args, "--output-dir", str(tmp_path / "yes"),
                 "--refresh-negatives-every", "5"]) == 0
    refreshes = rows(tmp_path / "yes", "refresh")
    assert [r["step"] for r in refreshes] == [1]  # before step 1 only (2 steps < 5)


@pytest.mark.parametrize("kw, message", [
    ({"refresh_negatives_every": 0}, "must be a number of steps > 0 or 'epoch'"),
    ({"refresh_negatives_every": "often"}, "must be a number of steps > 0 or 'epoch'"),
    ({"refresh_negatives_every": True}, "must be a number of steps > 0 or 'epoch'"),
    ({"num_hard_negatives": 0}, "mines this many negatives per record"),
    ({"refresh_negatives_every": None, "negatives_corpus": "."}, "give it too"),
    ({"negatives_corpus": "/nonexistent"}, "must be a BEIR folder holding corpus.jsonl"),
    ({"negatives_rank_window": "a:b"}, "--negatives-rank-window must be START:END"),
    ({"negatives_rank_window": "10:5"}, "--negatives-rank-window must satisfy"),
    ({"negatives_rank_window": "0:1"}, "fewer than --num-hard-negatives 2"),
    ({"distill": "kl"}, "--distill: cannot be combined with --refresh-negatives-every"),
])
def test_bad_values_are_refused_before_step_1(assets, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(assets, tmp_path / "run", **kw).validate()
    assert not (tmp_path / "run").exists()


def test_several_sources_and_a_bad_flag_are_refused(assets, tmp_path, capsys):
    tiny, data = assets
    with pytest.raises(ConfigError, match="one --train-data source"):
        config(assets, tmp_path / "run", train_data=[{"path": str(data), "name": "a"},
                                                     {"path": str(data), "name": "b"}]).validate()
    assert main(["train", "--model", str(tiny), "--train-data", str(data), "--output-dir",
                 str(tmp_path / "run"), "--num-hard-negatives", "2",
                 "--refresh-negatives-every", "-3"]) != 0
    assert "--refresh-negatives-every" in capsys.readouterr().err


def test_pairs_left_short_are_completed_at_random_never_with_a_positive(assets, tmp_path,
                                                                         capsys):
    """A margin no candidate passes: every negative is drawn at random from the pool, none a
    positive of its query, and the log says so."""
    out = tmp_path / "run"
    train(config(assets, out, max_steps=2, negatives_margin=10.0))
    assert "64 pair(s) had fewer than 2 left after filtering, completed with 128 document(s) " \
        "drawn at random" in capsys.readouterr().out
    negs, _ = negatives_of(out / "checkpoint-000002")
    records = load_records(assets[1])
    positives: dict[str, set[str]] = {}
    for r in records:
        positives.setdefault(r.query_id, set()).add(r.positive_id)
    assert all(not set(n) & positives[r.query_id] and len(set(n)) == 2
               for r, n in zip(records, negs))


@pytest.mark.slow
def test_two_gloo_ranks_mine_what_one_process_mines(assets, tmp_path):
    tiny, data = assets
    common = ["--model", str(tiny), "--train-data", str(data), "--max-steps", "1",
              "--warmup-steps", "1", "--grad-cache-chunk", "4", "--lora-r", "0",
              "--max-length", "48", "--no-eval-at-start", "--num-hard-negatives", "2",
              "--refresh-negatives-every", "1", "--negatives-max-score-ratio", "0.97",
              "--eval-batch-size", "7", "--report-to", "none"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    for prefix, batch, out in (
            ([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2", "-m", "bigbatch.cli"], "4", tmp_path / "two"),
            ([sys.executable, "-m", "bigbatch.cli"], "8", tmp_path / "one")):
        proc = subprocess.run([*prefix, "train", *common, "--batch-size", batch,
                               "--output-dir", str(out)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two, one = negatives_of(tmp_path / "two" / "checkpoint-000001"), \
        negatives_of(tmp_path / "one" / "checkpoint-000001")
    assert two == one and one[1] == 0
