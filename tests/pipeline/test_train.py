"""``bigbatch train`` end to end on a tiny model and a 64-pair SciFact slice: exact resume,
atomic checkpoints, bad records stopped before step 1, and the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.train import TrainConfig, train
from bigbatch.train.checkpoint import latest_checkpoint


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


def stop_after(n):
    """An ``on_step_end`` callback that ends the run right after step ``n`` (its checkpoint
    written, if one was due), as a kill would."""
    return lambda step, state: step >= n


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=3, max_steps=6, warmup_steps=2, save_steps=3, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, lora_dropout=0.1, lr=1e-3,
                max_length=48, seed=3, save_total_limit=5)
    base.update(kw)
    return TrainConfig(**base)


def train_losses(out):
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def logged_steps(out, kind="train"):
    """Every step ``metrics.jsonl`` has a row of ``kind`` for, in file order (repeats kept)."""
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == kind]


def tensorboard_steps(out, tag="train/loss"):
    """The steps TensorBoard shows for ``tag`` (it drops those a ``purge_step`` hides)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(out) / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def final_weights(out):
    d = Path(out) / "final"
    f = d / "adapter_model.safetensors"
    return load_file(f if f.exists() else d / "model.safetensors")


@pytest.mark.parametrize("variant", ["lora", "full", "float16-epochs"])
def test_resume_equals_a_run_that_never_stopped(assets, tmp_path, variant):
    """float16-epochs: a GradScaler's state, --epochs crossing an epoch boundary (64 records,
    batch 8: 8 steps an epoch, 1.25 epochs) and the logit scale's own learning rate."""
    kw = {"lora": {}, "full": {"lora_r": 0},
          "float16-epochs": {"dtype": "float16", "epochs": 1.25, "logit_scale_lr": 1e-2,
                             "save_steps": 4}}[variant]
    steps = 10 if "epochs" in kw else 6
    straight = train(config(assets, tmp_path / "a", **kw))
    # killed one step after its last checkpoint: that step was logged, but the run resumes
    # from the checkpoint (and must not log it twice)
    saved = kw.get("save_steps", 3)
    stopped = train(config(assets, tmp_path / "b", **kw), on_step_end=stop_after(saved + 1))
    assert stopped["stopped"] and latest_checkpoint(tmp_path / "b").name == f"checkpoint-{saved:06d}"
    train(config(assets, tmp_path / "b", resume=str(tmp_path / "b"), **kw))
    every = list(range(1, steps + 1))
    assert logged_steps(tmp_path / "a") == logged_steps(tmp_path / "b") == every
    if importlib.util.find_spec("tensorboard") is not None:
        assert tensorboard_steps(tmp_path / "b") == every
    la, lb = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-6, (s, la[s], lb[s])
    wa, wb = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k
    assert straight["steps"] == steps


def test_kill_during_checkpoint_write_keeps_previous(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        if "checkpoint-000004" in str(f) and str(f).endswith("trainer_state.pt"):
            raise KeyboardInterrupt("killed while writing the checkpoint")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(config(assets, out, save_steps=2))
    monkeypatch.setattr(torch, "save", real_save)
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-000002" in names and "checkpoint-000004" not in names
    assert not [n for n in names if ".tmp-" in n]          # the partial write was removed
    # a hard kill would leave a hidden temporary directory: it is never taken for a checkpoint
    (out / ".checkpoint-000004.tmp-999").mkdir()
    assert latest_checkpoint(out).name == "checkpoint-000002"
    summary = train(config(assets, out, save_steps=2, resume=str(out)))
    assert summary["steps"] == 6 and (out / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_bad_record_stops_before_step_one(assets, tmp_path, capsys):
    tiny, _ = assets
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"query": "q", "positive": "p"}\n{"query": "q2"}\n')
    out = tmp_path / "run"
    rc = main(["train", "--model", str(tiny), "--train-data", str(bad), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{bad}:2, field 'positive': missing positive" in err
    assert not (out / "metrics.jsonl").exists() and latest_checkpoint(out) is None


def test_command_line_end_to_end(assets, tmp_path, capsys):
    tiny, data = assets
    out = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("batch_size: 16\ngrad_cache_chunk: 4\nlora_r: 0\nlr: 1.0e-3\n")
    rc = main(["train", "--config", str(cfg), "--model", str(tiny), "--train-data", str(data),
               "--eval-data", str(data), "--output-dir", str(out), "--max-steps", "4",
               "--warmup-steps", "1", "--eval-steps", "2", "--save-steps", "2",
               "--max-length", "48", "--eval-batch-size", "32"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "base, full test split (20)" in printed and "fine-tuned, full test split" in printed
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "temperature", "examples_per_s", "accuracy", "grad_norm"):
        assert key in train_rows[0]
    assert (out / "best" / "model" / "modules.json").exists()
    assert (out / "final" / "model.safetensors").exists()
    assert (out / "training_curves.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.*"))
    resolved = (out / "config.yaml").read_text()
    assert "batch_size: 16" in resolved and "max_steps: 4" in resolved
    assert latest_checkpoint(out).name == "checkpoint-000004"
    from sentence_transformers import SentenceTransformer
    emb = SentenceTransformer(str(out / "final"), device="cpu").encode(["a claim"])
    assert emb.shape == (1, 32)


def test_a_bad_evaluation_split_stops_the_run_before_step_one(assets, tmp_path):
    from bigbatch.errors import DataError

    tiny, data = assets
    out = tmp_path / "run"
    with pytest.raises(DataError, match="qrels file not found"):
        train(config(assets, out, eval_data=str(data), eval_split="dev"))
    assert latest_checkpoint(out) is None and not (out / "metrics.jsonl").exists()


def test_the_weights_are_saved_before_the_final_evaluation(assets, tmp_path, monkeypatch):
    """An evaluation that fails at the end (out of memory, a bug) loses no training."""
    import bigbatch.retrieval.evaluate

    def failing(*a, **kw):
        raise MemoryError("evaluation ran out of memory")

    monkeypatch.setattr(bigbatch.retrieval.evaluate, "evaluate_beir", failing)
    out = tmp_path / "run"
    with pytest.raises(MemoryError):
        train(config(assets, out, eval_data=str(assets[1]), max_steps=4, save_steps=0))
    assert latest_checkpoint(out).name == "checkpoint-000004"
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_resume_refuses_other_data_settings_or_process_count(assets, tmp_path):
    import shutil

    from bigbatch.errors import ConfigError

    out = tmp_path / "run"
    train(config(assets, out), on_step_end=stop_after(3))
    with pytest.raises(ConfigError, match="batch_size=8, this run has 16"):
        train(config(assets, out, batch_size=16, resume=str(out)))
    with pytest.raises(ConfigError, match="seed=3, this run has 7"):
        train(config(assets, out, seed=7, resume=str(out)))
    ckpt = latest_checkpoint(out)
    shutil.copy(ckpt / "rng_state_rank0.pt", ckpt / "rng_state_rank1.pt")
    with pytest.raises(ConfigError, match="written by 2 process"):
        train(config(assets, out, resume=str(out)))


def test_best_follows_the_metric_direction_and_the_logged_lr_is_the_one_used(assets, tmp_path):
    """neg_sim is better when lower; the lr logged for a step is the rate that step used."""
    out = tmp_path / "run"
    summary = train(config(assets, out, eval_data=str(assets[1]), eval_steps=1, max_steps=4,
                           best_metric="neg_sim", scheduler="constant", warmup_steps=4,
                           eval_batch_size=64))
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["neg_sim"] for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [1, 2, 3, 4]
    assert summary["best"] == min(evals.values())
    assert summary["best_step"] == min(evals, key=evals.get)
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    assert lrs == pytest.approx([1e-3 * s / 4 for s in (1, 2, 3, 4)])  # warmup from 1/4


def test_a_max_length_beyond_the_models_positions_is_refused(assets, tmp_path):
    from bigbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-length: 200 is more than the 128 positions"):
        train(config(assets, tmp_path / "run", max_length=200))


def test_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(assets, tmp_path, capsys):
    out = tmp_path / "run"
    train(config(assets, out, save_steps=2, save_total_limit=2))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000004",
                                                                "checkpoint-000006"]
    capsys.readouterr()
    # branch from checkpoint-4 with another learning rate; killed after step 5, before a save
    branch = dict(save_steps=2, save_total_limit=2, lr=1e-4)
    train(config(assets, out, resume=str(out / "checkpoint-000004"), **branch),
          on_step_end=stop_after(5))
    moved = list(out.glob("abandoned-*"))
    assert len(moved) == 1
    # the abandoned run's later checkpoint, and its final/ and summary (it had finished)
    assert sorted(p.name for p in moved[0].iterdir()) == ["checkpoint-000006", "final",
                                                          "metrics.jsonl", "summary.json"]
    assert (moved[0] / "checkpoint-000006" / "trainer_state.pt").exists()   # nothing deleted
    assert "checkpoint-000006, final, summary.json); they belong to" in capsys.readouterr().out
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    # the checkpoint resumed from is kept (no newer one yet) and a plain --resume takes it
    assert latest_checkpoint(out).name == "checkpoint-000004"
    # one checkpoint kept, one saved each step: the new run's checkpoint-5 replaces checkpoint-4
    train(config(assets, out, resume=str(out), **{**branch, "save_steps": 1,
                                                   "save_total_limit": 1}),
          on_step_end=stop_after(5))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000005"]
    assert list(out.glob("abandoned-*")) == moved


@pytest.mark.parametrize("best_step", [2, 6])
def test_a_best_model_of_the_abandoned_timeline_is_set_aside_too(tmp_path, best_step):
    """best/ saved after the resumed step is the abandoned timeline's: the resumed run's
    record of its best does not know it, so it goes with the later checkpoints."""
    from bigbatch.train.checkpoint import abandon_later_checkpoints

    for name, step in (("checkpoint-000004", 4), ("checkpoint-000006", 6), ("best", best_step)):
        (tmp_path / name).mkdir()
        torch.save({"state": {"step": step}, "optimizer": {}}, tmp_path / name / "trainer_state.pt")
    dest = abandon_later_checkpoints(tmp_path, 4)
    moved = sorted(p.name for p in dest.iterdir())
    assert moved == (["best", "checkpoint-000006"] if best_step > 4 else ["checkpoint-000006"])
    assert (tmp_path / "best").exists() == (best_step <= 4)
    assert (tmp_path / "checkpoint-000004").exists()


def test_resume_drops_the_metrics_rows_it_logs_again(tmp_path):
    from bigbatch.train.logging import RunLogger

    f = tmp_path / "metrics.jsonl"
    rows = [{"kind": "eval", "step": 0}] + [{"kind": "train", "step": s} for s in range(1, 6)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')  # torn by a kill
    RunLogger(tmp_path, resume_step=3).close()
    assert [json.loads(l)["step"] for l in f.read_text().splitlines()] == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "tensorboard") == [
        "metrics.jsonl"]                                            # no temporary file left


def test_a_kill_between_the_renames_of_a_replacement_is_recovered(assets, tmp_path):
    out = tmp_path / "run"
    train(config(assets, out), on_step_end=stop_after(3))
    # the state a hard kill leaves while checkpoint-3 is being rewritten: the old copy moved
    # aside, the new one complete but not yet renamed into place; and an older write's debris
    os.replace(out / "checkpoint-000003", out / ".checkpoint-000003.old-4242")
    shutil.copytree(out / ".checkpoint-000003.old-4242", out / ".checkpoint-000003.tmp-4242")
    (out / ".final.tmp-4241").mkdir()
    (out / ".metrics.jsonl.tmp-4241").write_text("{")
    summary = train(config(assets, out, resume=str(out)))
    assert summary["steps"] == 6 and (out / "final" / "adapter" / "adapter_model.safetensors").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_recover_output_dir(tmp_path, monkeypatch):
    from bigbatch.train import checkpoint as C

    with C.atomic_dir(tmp_path / "best") as t:
        (t / "weights").write_text("step 100")
    real, calls = os.replace, []

    def killed_after_first(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("SIGKILL between the two renames")
        return real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(C.os, "replace", killed_after_first)
        with pytest.raises(KeyboardInterrupt), C.atomic_dir(tmp_path / "best") as t:
            (t / "weights").write_text("step 200")
    assert not (tmp_path / "best").exists()
    # a target that exists next to an old copy whose deletion was cut short, and another
    # process's unfinished write
    (tmp_path / "final").mkdir()
    (tmp_path / ".final.old-7").mkdir()
    (tmp_path / ".checkpoint-000002.tmp-8").mkdir()
    done = C.recover_output_dir(tmp_path)
    assert (tmp_path / "best" / "weights").read_text() == "step 100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "final"]
    assert len(done) == 4 and done[0].startswith(f"restored {tmp_path / 'best'}")


def test_atomic_dir_syncs_the_parent_after_the_renames(tmp_path, monkeypatch):
    from bigbatch.train import checkpoint as C

    synced = []
    monkeypatch.setattr(C, "fsync_dir", lambda d: synced.append(
        (Path(d), (tmp_path / "x" / "f").exists())))
    (tmp_path / "x").mkdir()
    with C.atomic_dir(tmp_path / "x") as t:
        (t / "f").write_text("new")
    assert (tmp_path, True) in synced       # the directory holding the renamed entries


def test_resuming_a_finished_run_redoes_nothing(assets, tmp_path, capsys):
    _, data = assets
    out = tmp_path / "run"
    kw = dict(eval_data=str(data), eval_batch_size=64, max_steps=3, save_steps=2)
    first = train(config(assets, out, **kw))
    files = [p for p in out.rglob("*") if p.is_file()]
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    capsys.readouterr()
    again = train(config(assets, out, resume=str(out), **kw))
    assert logged_steps(out, "eval") == [3] and logged_steps(out) == [1, 2, 3]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before
    assert sorted(p for p in out.rglob("*") if p.is_file()) == sorted(files)
    assert "already finished (3 of 3 steps" in capsys.readouterr().out
    assert again["steps"] == 3 and again["final"] == first["final"] and "encoder" in again


def test_the_final_checkpoint_records_a_best_found_by_the_final_evaluation(assets, tmp_path,
                                                                           monkeypatch):
    """The final checkpoint is written before the final evaluation; when that evaluation is
    the best, the checkpoint is written again so a resume (to train further) knows it."""
    import bigbatch.retrieval.evaluate

    calls = []

    def rising(*a, **kw):  # each evaluation better than the last: the final one is the best
        calls.append(1)
        return {"ndcg@10": 0.1 * len(calls)}

    monkeypatch.setattr(bigbatch.retrieval.evaluate, "check_beir_split", lambda *a, **kw: None)
    monkeypatch.setattr(bigbatch.retrieval.evaluate, "evaluate_beir", rising)
    out = tmp_path / "run"
    summary = train(config(assets, out, eval_data="unused", eval_steps=2, max_steps=4,
                           save_steps=0))
    assert summary["best_step"] == 4 and summary["best"] == pytest.approx(0.2)
    saved = torch.load(out / "checkpoint-000004" / "trainer_state.pt", weights_only=False)
    assert (saved["state"]["best"], saved["state"]["best_step"]) == (summary["best"], 4)


def test_resume_compares_the_training_data_by_resolved_path(assets, tmp_path, monkeypatch):
    """The same file given another way (relative, from another directory) resumes; another
    file with the same records does not."""
    import shutil

    from bigbatch.errors import ConfigError

    tiny, data = assets
    out = tmp_path / "run"
    monkeypatch.chdir(Path(data).parent)
    train(config(assets, out, train_data=Path(data).name),  # relative
          on_step_end=stop_after(3))
    monkeypatch.chdir(tmp_path)
    train(config(assets, out, train_data=str(data), resume=str(out)),
          on_step_end=stop_after(4))
    copy = shutil.copytree(data, tmp_path / "copy")
    with pytest.raises(ConfigError, match="was trained on"):
        train(config(assets, out, train_data=str(copy), resume=str(out)))


def test_swift_system_prompts_are_applied_or_the_run_stops(assets, tmp_path, capsys):
    """ms-swift applies each conversation's system message; training on swift data checks
    that the encoder's prefix holds it before step 1, naming the flag that applies it."""
    tiny, _ = assets
    data = tmp_path / "swift.jsonl"
    data.write_text("".join(json.dumps({
        "messages": [{"role": "system", "content": "Find the claim."},
                     {"role": "user", "content": f"query {i}"}],
        "positive_messages": [[{"role": "user", "content": f"passage {i}"}]]}) + "\n"
        for i in range(8)))
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny), "--train-data", str(data), "--output-dir", str(out),
            "--batch-size", "4", "--max-steps", "1", "--eval-steps", "0", "--save-steps", "0",
            "--no-eval-at-start", "--max-length", "16"]
    assert main(args) == 2
    assert "--query-prefix 'Find the claim. '" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()
    assert main([*args, "--query-prefix", "Find the claim. "]) == 0


def test_a_base_model_better_than_every_trained_step_is_noted():
    from bigbatch.train.loop import base_beats_best

    note = base_beats_best({"ndcg@10": 0.40}, 0.35, 20, "ndcg@10", False)
    assert note and "0.4000" in note and "step 20" in note
    assert base_beats_best({"ndcg@10": 0.30}, 0.35, 20, "ndcg@10", False) is None
    assert base_beats_best({"neg_sim": 0.10}, 0.20, 5, "neg_sim", True)  # lower is better
    assert base_beats_best({"neg_sim": 0.30}, 0.20, 5, "neg_sim", True) is None
    assert base_beats_best(None, 0.35, 20, "ndcg@10", False) is None  # no base evaluation
    assert base_beats_best({"ndcg@10": float("nan")}, 0.35, 20, "ndcg@10", False) is None


@pytest.mark.parametrize("file_budget,flag,steps,said", [
    ("epochs: 2", ["--max-steps", "2"], 2, "2 steps (--max-steps)"),
    ("max_steps: 40", ["--epochs", "0.25"], 2, "2 steps (--epochs 0.25)"),
])
def test_the_start_line_says_which_step_budget_ruled(assets, tmp_path, capsys, file_budget,
                                                    flag, steps, said):
    """Trap 6 of issue 34: `--max-steps 3` under a YAML's `epochs: 2` ran the file's epochs.
    The flag wins, and the start line names the option that set the steps (64 pairs at batch
    8: 8 steps per epoch)."""
    tiny, data = assets
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{file_budget}\nbatch_size: 8\ngrad_cache_chunk: 4\nlora_r: 0\n"
                   f"max_length: 32\nwarmup_steps: 0\nsave_steps: 0\neval_at_start: false\n"
                   f"report_to: [none]\n")
    assert main(["train", "--config", str(cfg), "--model", str(tiny), "--train-data", str(data),
                 "--output-dir", str(tmp_path / "run"), *flag]) == 0
    assert said in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == steps
