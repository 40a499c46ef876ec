"""Defects a probe found in the commands (issue 29): ``--overwrite`` moving the training data
away, a resume onto another base model, a model folder without its tokenizer, and an output
path that is an input of the same command. Each test fails on the code before the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.cli import main
from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    return tiny_bert(root / "tiny"), scifact_slice(root / "sf"), root


def config(tiny, data, out, **kw):
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=8, max_steps=2, warmup_steps=1, save_steps=2, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, max_length=32, seed=5)
    base.update(kw)
    return TrainConfig(**base)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------- --overwrite and inputs
@pytest.mark.parametrize("where", ["train_data", "model", "config"])
def test_overwrite_never_moves_an_input_of_the_run(assets, tmp_path, capsys, where):
    """``--train-data U/train.jsonl --output-dir U --overwrite`` used to move the data into
    U/previous-*/ after indexing it, then die with a FileNotFoundError traceback."""
    tiny, data, _ = assets
    user = tmp_path / "U"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    train_data = data
    model = tiny
    argv = []
    if where == "train_data":
        train_data = user / "train.jsonl"
        main(["make-pairs", str(data), str(train_data), "--max-pairs", "32"])
    elif where == "model":
        model = shutil.copytree(tiny, user / "model")
    else:
        (user / "c.yaml").write_text("max_length: 32\n")
        argv = ["--config", str(user / "c.yaml")]
    before = snapshot(user)
    code = main(["train", "--model", str(model), "--train-data", str(train_data), *argv,
                 "--output-dir", str(user), "--overwrite", "--batch-size", "8",
                 "--max-steps", "1", "--no-eval-at-start", "--lora-r", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--overwrite:" in err and "holds an input of this run" in err and "would move it" in err
    assert snapshot(user) == before  # nothing moved, nothing written


# ---------------------------------------------------------------- resume and the base model
def test_resume_refuses_another_base_model_of_the_same_shapes(assets, tmp_path):
    """A LoRA run resumed silently on another base model (two steps on one, two on the
    other, exit 0): the checkpoint records the model's path and fingerprint."""
    tiny, data, root = assets
    other = tiny_bert(root / "other", seed=1)  # same shapes, other weights
    run = tmp_path / "run"
    train(config(tiny, data, run, max_steps=2))
    with pytest.raises(ConfigError, match=r"--resume: .*checkpoint-000002 was trained from the "
                                          r"model .*tiny \(fingerprint [0-9a-f]{16}.*another model"):
        train(config(other, data, run, max_steps=4, resume=str(run)))
    copy = shutil.copytree(tiny, tmp_path / "moved")  # the same model elsewhere resumes
    summary = train(config(copy, data, run, max_steps=3, resume=str(run)))
    assert summary["steps"] == 3


# ---------------------------------------------------------------- a model without its tokenizer
@pytest.mark.parametrize("command", ["eval", "train", "mine"])
def test_a_model_folder_without_its_tokenizer_is_refused(assets, tmp_path, capsys, command):
    """transformers builds a 5-token tokenizer; eval gave nDCG@10 0.0000 and exit 0."""
    tiny, data, _ = assets
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny / name, bare / name)
    argv = {"eval": ["eval", "--model", str(bare), "--data", str(data), "--no-cache"],
            "mine": ["mine", "--model", str(bare), "--data", str(data), "--output",
                     str(tmp_path / "mined.jsonl"), "--no-cache"],
            "train": ["train", "--model", str(bare), "--train-data", str(data), "--output-dir",
                      str(tmp_path / "run"), "--max-steps", "1", "--no-eval-at-start",
                      "--max-length", "32", "--pooling", "mean", "--query-prefix", "",
                      "--doc-prefix", ""]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "its tokenizer has 5 tokens but the model's input embeddings have 30,522 rows" in err
    assert "holds no tokenizer file" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "mined.jsonl").exists()


# ---------------------------------------------------------------- an output that is an input
@pytest.mark.parametrize("case", ["eval", "mine", "make-pairs", "convert", "convert-beir"])
def test_an_output_that_is_an_input_of_the_command_is_refused(assets, tmp_path, capsys, case):
    tiny, data, _ = assets
    d = shutil.copytree(data, tmp_path / "D")
    corpus = d / "corpus.jsonl"
    train_file = tmp_path / "train.jsonl"
    train_file.write_text(json.dumps({"query": "q", "positive": "p"}) + "\n")
    argv = {"eval": ["eval", "--model", str(tiny), "--data", str(d), "--output", str(corpus)],
            "mine": ["mine", "--model", str(tiny), "--data", str(d), "--output", str(corpus)],
            "make-pairs": ["make-pairs", str(d), str(corpus)],
            "convert": ["convert", str(train_file), str(train_file), "--to", "st"],
            "convert-beir": ["convert", str(train_file), str(tmp_path), "--to", "beir"],
            }[case]
    before = snapshot(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is an input of this command" in err, err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- a full disk
@pytest.mark.parametrize("case", ["eval", "mine", "make-pairs"])
def test_a_full_disk_names_the_output_and_leaves_what_was_there(assets, tmp_path, capsys,
                                                                monkeypatch, case):
    """A command's output meeting a full disk gave a traceback; now one line names the file,
    the free space and that the file there before is kept."""
    import errno
    import os

    tiny, data, _ = assets
    out = tmp_path / "out" / ("result.json" if case == "eval" else "pairs.jsonl")
    out.parent.mkdir()
    out.write_text("what was there before\n")
    argv = {"eval": ["eval", "--model", str(tiny), "--data", str(data), "--output", str(out)],
            "mine": ["mine", "--model", str(tiny), "--data", str(data), "--output", str(out),
                     "--num-negatives", "1", "--max-score-ratio", "0", "--min-negatives", "1"],
            "make-pairs": ["make-pairs", str(data), str(out)]}[case]
    real_replace = os.replace

    def full(src, dst, *a, **k):  # the disk fills as the output is put in place
        if str(dst) == str(out):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", full)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"could not write {out}: No space left on device (" in err and "free on" in err
    assert "Free some space, then" in err and "--save-total-limit" not in err  # (not a run)
    assert "Traceback" not in err
    assert out.read_text() == "what was there before\n"
