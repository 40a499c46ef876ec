"""The run folder is the user's, and every input gets a clear answer: a new run never writes
over a finished run or the user's own files (``--overwrite`` moves them aside), checkpoints
are rotated and resumed by the run that wrote them, and bad inputs to ``train``, ``eval``,
``mine`` and ``render-pages`` stop with one line naming the option or file, before any work
and with nothing written (each is listed in docs/bad-inputs.md).

New names are imported inside the tests, so that each test fails on its own against the
code before this change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.errors import BigBatchError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    tiny = tiny_bert(root / "tiny")
    corrupt = shutil.copytree(tiny, root / "corrupt")
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # cut short, as by an interrupted copy
    return tiny, scifact_slice(root / "sf"), corrupt


def config(assets, out, **kw):
    tiny, data, _ = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=8, max_steps=2, warmup_steps=1, save_steps=0, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, max_length=32, seed=5,
                save_total_limit=2)
    base.update(kw)
    return TrainConfig(**base)


def train_argv(assets, out, *extra):
    tiny, data, _ = assets
    return ["train", "--model", str(tiny), "--train-data", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--grad-cache-chunk", "8", "--max-steps", "2",
            "--warmup-steps", "1", "--save-steps", "0", "--eval-steps", "0",
            "--no-eval-at-start", "--lora-r", "4", "--lora-alpha", "8", "--max-length", "32",
            *extra]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its contents (folders as empty values)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def logged_steps(out):
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "train"]


def final_weights(out):
    return load_file(Path(out) / "final" / "adapter" / "adapter_model.safetensors")


# ---------------------------------------------------------------- the three defects
def test_a_second_run_into_a_finished_runs_folder_is_refused(assets, tmp_path, capsys):
    """Defect 1: it overwrote final/, the checkpoint, config.yaml and summary.json, appended
    to metrics.jsonl (steps 1, 2, 1, 2), added a second TensorBoard file, exit 0."""
    out = tmp_path / "run"
    assert main(train_argv(assets, out)) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(train_argv(assets, out, "--lr", "1e-3")) == 2
    err = capsys.readouterr().err
    assert f"--output-dir: {out} already holds a training run" in err
    assert f"--resume {out}" in err and "new --output-dir" in err and "--overwrite" in err
    assert snapshot(out) == before                         # nothing written over
    assert logged_steps(out) == [1, 2]
    assert len(list((out / "tensorboard").glob("events.*"))) == 1


def test_overwrite_moves_a_longer_old_run_aside_and_the_new_run_owns_the_folder(assets,
                                                                                 tmp_path):
    """Defect 2: an older run of 8 steps (checkpoints 6 and 8 kept) outranked a new 3-step
    run: its checkpoint-3 was rotated away at once, and --resume then said "done: 8 steps"
    and put the old run's step-8 weights into final/."""
    out = tmp_path / "run"
    train(config(assets, out, max_steps=8, save_steps=2))
    old = sorted(p.name for p in out.iterdir())
    new = train(config(assets, out, max_steps=3, lr=1e-3, seed=9, overwrite=True))
    archives = list(out.glob("previous-*"))
    assert len(archives) == 1                              # the old run, whole: nothing deleted
    assert sorted(p.name for p in archives[0].iterdir()) == old
    assert (archives[0] / "checkpoint-000008" / "trainer_state.pt").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003"]
    assert logged_steps(out) == [1, 2, 3]
    assert len(list((out / "tensorboard").glob("events.*"))) == 1
    weights = final_weights(out)
    again = train(config(assets, out, max_steps=3, lr=1e-3, seed=9, resume=str(out)))
    assert again["steps"] == new["steps"] == 3
    for k, v in final_weights(out).items():
        assert torch.equal(v, weights[k]), k


def test_rotation_and_resume_go_by_the_run_that_wrote_the_checkpoints(tmp_path):
    """Another run's checkpoints (here a longer run's 6 and 8) are never rotated away for, nor
    resumed instead of, the folder's own run's (3)."""
    from bigbatch.train.checkpoint import latest_checkpoint, rotate_checkpoints

    def checkpoint(step, run):
        d = tmp_path / f"checkpoint-{step:06d}"
        d.mkdir()
        torch.save({"state": {"step": step}}, d / "trainer_state.pt")
        (d / "run.json").write_text(json.dumps({"run_id": run, "step": step}))

    checkpoint(6, "old")
    checkpoint(8, "old")
    checkpoint(3, "new")                                   # written last
    assert latest_checkpoint(tmp_path).name == "checkpoint-000003"
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "new"}))
    rotate_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-000003", "checkpoint-000006", "checkpoint-000008"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-000003"
    checkpoint(4, "new")
    rotate_checkpoints(tmp_path, keep=1)                   # the run's own older one goes
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-000004", "checkpoint-000006", "checkpoint-000008"]


def test_the_users_own_files_in_the_output_folder_are_never_written_over(assets, tmp_path):
    """Defect 3: config.yaml and summary.json of the user's were written over."""
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("config.yaml", "summary.json", "notes.txt"):
        (out / name).write_text(f"the user's {name}\n")
    before = snapshot(out)
    with pytest.raises(BigBatchError, match=r"is not empty \(config.yaml, notes.txt, "
                                            r"summary.json\) and holds no bigbatch run"):
        train(config(assets, out))
    assert snapshot(out) == before
    train(config(assets, out, max_steps=1, overwrite=True))
    archive = next(out.glob("previous-*"))
    for name in ("config.yaml", "summary.json", "notes.txt"):
        assert (archive / name).read_text() == f"the user's {name}\n"
    assert (out / "final").is_dir() and (out / "run.json").exists()


def test_an_empty_existing_folder_is_fine_and_a_resume_continues_in_its_own(assets, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    train(config(assets, out, max_steps=3, save_steps=1), on_step_end=lambda s, _: s >= 2)
    summary = train(config(assets, out, max_steps=3, save_steps=1, resume=str(out)))
    assert summary["steps"] == 3 and logged_steps(out) == [1, 2, 3]
    assert not list(out.glob("previous-*"))


# ---------------------------------------------------------------- bad inputs, one table
def _dup_yaml(tmp_path, assets):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1.0e-3\nbatch_size: 8\nlr: 2.0e-3\n")
    return f


# id -> (argv given the assets and a work folder, expected message); each stops with exit 2,
# the message on stderr, and nothing written under the work folder
BAD_INPUTS = {
    "train --output-dir a file": (
        lambda a, w: train_argv(a, w / "file.txt"), "--output-dir: {w}/file.txt is a file"),
    "train --output-dir under a file": (
        lambda a, w: train_argv(a, w / "file.txt" / "run"), "is a file"),
    "train --output-dir unwritable": (
        lambda a, w: train_argv(a, "/proc/bigbatch-run"), "--output-dir: cannot write in /proc"),
    "train --device cuda without CUDA": (
        lambda a, w: train_argv(a, w / "run", "--device", "cuda"),
        "--device: CUDA is not available here"),
    "train corrupt model.safetensors": (
        lambda a, w: [*train_argv(a, w / "run"), "--model", str(a[2])],
        "{corrupt}/model.safetensors: not a readable safetensors weights file"),
    "train --lr inf": (
        lambda a, w: train_argv(a, w / "run", "--lr", "inf"), "--lr: must be a finite number"),
    "train YAML key given twice": (
        lambda a, w: [*train_argv(a, w / "run"), "--config", str(_dup_yaml(w, a))],
        "c.yaml:3: 'lr' is given twice (also 'lr' at line 1)"),
    "train bad record (no empty folder left)": (
        lambda a, w: [*train_argv(a, w / "run"), "--train-data", str(w / "bad.jsonl")],
        "bad.jsonl:2, field 'positive'"),
    "eval --batch-size 0": (
        lambda a, w: ["eval", "--model", str(a[0]), "--data", str(a[1]), "--batch-size", "0"],
        "--batch-size: must be > 0 (got 0)"),
    "eval corrupt model.safetensors": (
        lambda a, w: ["eval", "--model", str(a[2]), "--data", str(a[1]), "--no-cache"],
        "{corrupt}/model.safetensors: not a readable safetensors weights file"),
    "eval --output unwritable": (
        lambda a, w: ["eval", "--model", str(a[0]), "--data", str(a[1]), "--no-cache",
                      "--max-length", "32", "--output", "/proc/bigbatch-eval.json"],
        "--output: cannot write in /proc"),
    "eval --device cuda without CUDA": (
        lambda a, w: ["eval", "--model", str(a[0]), "--data", str(a[1]), "--device", "cuda"],
        "--device: CUDA is not available here"),
    "mine --output unwritable": (
        lambda a, w: ["mine", "--model", str(a[0]), "--data", str(a[1]), "--no-cache",
                      "--max-length", "32", "--output", "/proc/bigbatch-hn.jsonl"],
        "--output: cannot write in /proc"),
    "mine finds no negatives": (
        lambda a, w: ["mine", "--model", str(a[0]), "--data", str(a[1]), "--no-cache",
                      "--output", str(w / "out" / "hn.jsonl"), "--max-score-ratio", "0.001",
                      "--num-negatives", "2", "--rank-window", "0:2", "--max-length", "32"],
        "mine: no negatives found"),
    "render-pages output a file": (
        lambda a, w: ["render-pages", str(a[1]), str(w / "file.txt"), "--max-docs", "5"],
        "render-pages: the output {w}/file.txt is a file"),
    "render-pages --size 0x0": (
        lambda a, w: ["render-pages", str(a[1]), str(w / "pages"), "--size", "0x0"],
        "--size: width and height must be > 0 pixels, got '0x0'"),
    "render-pages --size -5x10": (
        lambda a, w: ["render-pages", str(a[1]), str(w / "pages"), "--size=-5x10"],
        "--size: width and height must be > 0 pixels, got '-5x10'"),
    "render-pages --font missing": (
        lambda a, w: ["render-pages", str(a[1]), str(w / "pages"), "--font", str(w / "x.ttf")],
        "--font: no such font file: {w}/x.ttf"),
    "render-pages --font-size 0": (
        lambda a, w: ["render-pages", str(a[1]), str(w / "pages"), "--font-size", "0"],
        "--font-size: must be > 0 (got 0)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_stop_with_a_clear_message_and_write_nothing(assets, tmp_path, capsys,
                                                                monkeypatch, case):
    argv, expected = BAD_INPUTS[case]
    monkeypatch.setenv("BIGBATCH_NO_PROGRESS", "1")
    work = tmp_path / "work"
    work.mkdir()
    (work / "file.txt").write_text("a file\n")
    (work / "bad.jsonl").write_text('{"query": "q", "positive": "p"}\n{"query": "q2"}\n')
    if "without CUDA" in case:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        import bigbatch.train.loop

        def loaded(*a, **kw):
            raise AssertionError("the model was loaded before the device was checked")
        monkeypatch.setattr(bigbatch.train.loop, "build_encoder", loaded, raising=False)
    argv = argv(assets, work)
    before = snapshot(work)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert "bigbatch: error: " in err, err
    said = " ".join(err[err.index("bigbatch: error: "):].split())
    assert expected.format(w=work, corrupt=assets[2]) in said, err
    assert snapshot(work) == before


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
    OSError(28, "No space left on device"),
])
def test_a_full_disk_while_saving_a_checkpoint_names_the_file_and_the_free_space(
        assets, tmp_path, capsys, monkeypatch, error):
    out = tmp_path / "run"
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if "checkpoint-000002" in str(f) and str(f).endswith("trainer_state.pt"):
            raise error
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    assert main(train_argv(assets, out, "--save-steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"could not write {out}/checkpoint-000002/trainer_state.pt: " in err, err
    assert " free on " in err and f"continue with --resume {out}" in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".", "checkpoint"))) == [
        "checkpoint-000001"]                                 # the previous one, intact


# ---------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("at_step", [0, 3])
def test_ctrl_c_says_where_the_run_stopped_and_how_to_continue(assets, tmp_path, capsys,
                                                               monkeypatch, at_step):
    import bigbatch.train.loop as loop

    out = tmp_path / "run"
    real = loop.Trainer._optimize

    def interrupted(self, batch):
        if self.state["step"] == at_step:
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(loop.Trainer, "_optimize", interrupted)
    assert main(train_argv(assets, out, "--max-steps", "4", "--save-steps", "2")) == 130
    err = capsys.readouterr().err
    if at_step == 0:  # the folder it had created is gone: a new start needs no --overwrite
        assert "stopped before step 1; nothing was written" in err and not out.exists()
        return
    assert (f"stopped at step 3; continue with --resume {out} (from checkpoint-000002, "
            f"redoing steps 3-3)") in err, err
    monkeypatch.setattr(loop.Trainer, "_optimize", real)
    assert main(train_argv(assets, out, "--max-steps", "4", "--save-steps", "2",
                           "--resume", str(out))) == 0
    printed = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoint-000002'} (step 2 of 4)" in printed
    assert printed.strip().splitlines()[-1].startswith("done: 4 steps in ")


@pytest.mark.parametrize("command", ["eval", "mine"])
def test_ctrl_c_in_eval_or_mine_prints_one_line_and_writes_nothing(assets, tmp_path, capsys,
                                                                   monkeypatch, command):
    import bigbatch.encoders

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(bigbatch.encoders, "load_encoder", interrupted)
    out = tmp_path / "out.jsonl"
    assert main([command, "--model", str(assets[0]), "--data", str(assets[1]),
                 "--output", str(out)]) == 130
    assert capsys.readouterr().err.strip() == f"bigbatch {command}: stopped (Ctrl-C)"
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--temperature", "nan"),
                                        ("--max-grad-norm", "inf"), ("--epochs", "inf")])
def test_numbers_must_be_finite(flag, value):
    from bigbatch.cli import build_parser
    from bigbatch.errors import ConfigError
    from bigbatch.train import load_config

    args = build_parser().parse_args(["train", "--model", "m", "--train-data", "d", flag, value])
    over = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    with pytest.raises(ConfigError, match=f"{flag}: must be a finite number"):
        load_config(None, over)


def test_relative_paths_in_a_yaml_file_are_read_from_its_folder(tmp_path, monkeypatch):
    from bigbatch.train import load_config

    sub = tmp_path / "configs"
    (sub / "models" / "m").mkdir(parents=True)
    (sub / "models" / "m" / "config.json").write_text('{"model_type": "bert"}')
    f = sub / "c.yaml"
    f.write_text("model: models/m\ntrain_data: data/train.jsonl\noutput_dir: ../runs/x\n"
                 "eval_data: beir\n")
    monkeypatch.chdir(tmp_path / "configs" / "models")    # anywhere else
    c = load_config(f)
    assert (c.model, c.train_data, c.output_dir, c.eval_data) == (
        str(sub / "models" / "m"), str(sub / "data" / "train.jsonl"),
        str(tmp_path / "runs" / "x"), str(sub / "beir"))
    c = load_config(f, {"train_data": "here.jsonl", "model": "org/name"})  # flags: the cwd's
    assert (c.train_data, c.model) == (str(sub / "models" / "here.jsonl"), "org/name")
    c.write(tmp_path / "written.yaml")                      # absolute: reads back the same
    assert load_config(tmp_path / "written.yaml") == c


def test_a_key_given_twice_in_yaml_is_refused_with_file_and_line(tmp_path):
    from bigbatch.errors import ConfigError
    from bigbatch.train import load_config

    f = tmp_path / "c.yaml"
    f.write_text("model: m\ntrain-data: d\nbatch_size: 8\ntrain_data: e\n")
    with pytest.raises(ConfigError, match=r"c.yaml:4: 'train_data' is given twice \(also "
                                          r"'train-data' at line 2\)"):
        load_config(f)


# ---------------------------------------------------------------- what a newcomer reads
def _subparser(name):
    from bigbatch.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if hasattr(a, "choices") and a.choices
                and name in a.choices).choices[name]


def test_train_help_marks_model_and_train_data_required_and_names_overwrite():
    text = " ".join(_subparser("train").format_help().split())
    assert "--model MODEL required:" in text and "--train-data TRAIN_DATA required:" in text
    assert "(default )" not in text and "(default None)" not in text
    assert "--overwrite" in text and "previous-<timestamp>" in text
    assert "read from the YAML file's folder" in text


@pytest.mark.parametrize("command", ["mine", "eval", "render-pages", "convert"])
def test_every_option_has_a_description_and_a_default(command):
    p = _subparser(command)
    formatter = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_ = formatter._get_help_string(action) or ""
        assert help_.strip() and not help_.startswith("("), (command, action.dest)
        assert action.required or "default" in help_, (command, action.dest, help_)


def _metrics(n, unseen_n, **extra):
    m = {"ndcg@10": 0.5, "recall@1": 0.3, "recall@5": 0.6, "recall@10": 0.7, "mrr@10": 0.4,
         "margin": 0.2, "neg_sim": 0.1, "queries": float(n), **extra}
    return {**m, **{f"unseen/{k}": v for k, v in m.items() if k != "queries"},
            "unseen/queries": float(unseen_n)}


@pytest.mark.parametrize("unseen_n", [20, 7])
def test_the_result_table_names_unseen_queries_and_leaves_out_a_repeat(capsys, unseen_n):
    from bigbatch.retrieval.report import print_summary

    summary = {"steps": 4, "seconds": 3.0, "base": _metrics(20, unseen_n),
               "final": _metrics(20, unseen_n), "best": 0.1, "best_step": 2,
               "final_model": "runs/x/final"}
    print_summary(summary, "neg_sim", "test")
    out = capsys.readouterr().out
    assert "claims" not in out and "neg_sim" in out.splitlines()[1]
    assert ("unseen-document queries (7)" in out) == (unseen_n == 7)
    assert "best/: step 2, neg_sim 0.1000" in out
    assert out.strip().splitlines()[-1] == "done: 4 steps in 3 s; model in runs/x/final"
    print_summary({**summary, "base": None, "final": None, "best": None})
    assert capsys.readouterr().out.strip() == "done: 4 steps in 3 s; model in runs/x/final"


def test_evaluation_lines_are_table_rows_with_the_best_metric(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_argv(assets, out, "--max-steps", "1", "--eval-data", str(assets[1]),
                           "--eval-at-start", "--best-metric", "neg_sim",
                           "--eval-batch-size", "64")) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [l for l in lines if l.startswith("eval ")]
    assert rows[0].split() == ["eval", "step", "ndcg@10", "recall@1", "recall@10", "mrr@10",
                               "unseen/ndcg@10", "neg_sim"]
    assert [r.split()[1] for r in rows[1:]] == ["0", "1"] and len(rows[1].split()) == 8
    assert not [l for l in lines if "{'" in l]             # no Python dict
    assert any(l.startswith("best/: step 1, neg_sim ") for l in lines)


def _png_width(path):
    return int.from_bytes(Path(path).read_bytes()[16:20], "big")


def test_no_empty_evaluation_panel_without_evaluations(tmp_path):
    from bigbatch.train.logging import plot_metrics

    rows = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(tmp_path / "m.jsonl", tmp_path / "train.png")
    rows.append({"kind": "eval", "step": 3, "ndcg@10": 0.5})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(tmp_path / "m.jsonl", tmp_path / "both.png")
    assert _png_width(tmp_path / "train.png") < 0.7 * _png_width(tmp_path / "both.png")


# ---------------------------------------------------------------- the folder rule, unit by unit
def _folder(root, *names, run=None):
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).mkdir() if "." not in name else (root / name).write_text("x")
    if run:
        (root / "run.json").write_text(json.dumps({"run_id": run}))
    return root


# id -> (make the folder and the checkpoint resumed (or None), its run, overwrite, expected:
# None when the run may start there, else the message)
FOLDERS = {
    "new": (lambda t: (t / "new", None), None, False, None),
    "empty": (lambda t: (_folder(t / "e"), None), None, False, None),
    "only archives of --overwrite": (lambda t: (_folder(t / "a", "previous-1"), None), None,
                                     False, None),
    "a run": (lambda t: (_folder(t / "r", "final", run="A"), None), None, False,
              "already holds a training run (final/, run.json)"),
    "the user's files": (lambda t: (_folder(t / "u", "notes.txt"), None), None, False,
                         "is not empty (notes.txt) and holds no bigbatch run"),
    "resume into its own run's folder": (
        lambda t: (_folder(t / "r", "checkpoint-000002", run="A"), t / "r" / "checkpoint-000002"),
        "A", False, None),
    "resume into another run's folder": (
        lambda t: (_folder(t / "r", "final", run="B"), _folder(t / "o" / "checkpoint-000002")),
        "A", False, "already holds another training run"),
    "resume --overwrite of a checkpoint inside the folder it would move": (
        lambda t: (_folder(t / "r", "checkpoint-000002", run="B"),
                   t / "r" / "checkpoint-000002"), "A", True,
        "--overwrite: the checkpoint to resume"),
    "a file": (lambda t: ((t / "f.txt").write_text("x") and t / "f.txt", None), None, False,
               "is a file; give a folder"),
    "below a file": (lambda t: ((t / "f.txt").write_text("x") and t / "f.txt" / "run", None),
                     None, False, "cannot be a folder"),
    "unwritable": (lambda t: (Path("/proc/bigbatch-run"), None), None, False,
                   "--output-dir: cannot write in /proc"),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_who_may_start_a_run_in_an_output_folder(tmp_path, case):
    from bigbatch.errors import ConfigError
    from bigbatch.train.outdir import check_output_dir

    make, run, overwrite, expected = FOLDERS[case]
    out, resume = make(tmp_path)
    before = snapshot(tmp_path)
    if expected is None:
        plan = check_output_dir(out, overwrite=overwrite, resume=resume, resume_run=run)
        assert plan.create == (case == "new") and not plan.move_aside
    else:
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            check_output_dir(out, overwrite=overwrite, resume=resume, resume_run=run)
    assert snapshot(tmp_path) == before                    # checking writes nothing


def test_resume_of_a_run_without_checkpoints_or_beyond_max_steps_is_explained(tmp_path):
    from bigbatch.errors import ConfigError
    from bigbatch.train.resume import check_resumed_step, resume_path

    _folder(tmp_path / "r", "config.yaml", run="A")
    with pytest.raises(ConfigError, match="stopped before its first checkpoint .* --overwrite"):
        resume_path(str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="is at step 8, beyond this run's 3 steps"):
        check_resumed_step(tmp_path / "r" / "checkpoint-000008", 8, 3)


def test_a_gpu_index_beyond_those_present_is_refused(monkeypatch):
    from bigbatch.train.config import device_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_problem("cuda:3") == "there are 1 GPU(s) here (cuda:0 to cuda:0)"
    assert device_problem("cuda:0") is None and device_problem("cpu") is None
