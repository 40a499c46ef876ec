"""The weak answers of the probe closed as classes (issue 29, item 5): one error path for an
OS error on any file a run writes, one for a damaged JSON or YAML file of a model or
checkpoint folder, a warning (``--strict``: an error) for a step that cannot teach,
``--save-total-limit 0`` refused, strict JSON results, qrels checked against the corpus
before anything is embedded, and a missing model that is named at once."""

from __future__ import annotations

import builtins
import json
import shutil
import time

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.cli import main
from bigbatch.errors import ConfigError, DataError, OutputError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("weak")
    return tiny_bert(root / "tiny"), scifact_slice(root / "sf")


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=4,
                grad_cache_chunk=4, max_steps=2, warmup_steps=1, save_steps=0, eval_steps=0,
                eval_at_start=False, lora_r=0, max_length=32, seed=1)
    base.update(kw)
    return TrainConfig(**base)


def full_disk(monkeypatch, endswith):
    """``open`` of a path ending in ``endswith`` for writing fails as a full disk does."""
    real = builtins.open

    def fake(file, mode="r", *a, **kw):
        if str(file).endswith(endswith) and any(m in mode for m in "wa"):
            raise OSError(28, "No space left on device", str(file))
        return real(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake)


# ---------------------------------------------------------------- OS errors of written files
def test_a_full_disk_on_metrics_jsonl_is_named_with_the_free_space(assets, tmp_path,
                                                                   monkeypatch):
    full_disk(monkeypatch, "metrics.jsonl")
    out = tmp_path / "run"
    with pytest.raises(OutputError, match=r"could not write .*run/metrics.jsonl: No space left "
                                          r"on device \(.* free on .*\); is the disk full"):
        train(config(assets, out))


def test_a_full_disk_on_eval_output_leaves_no_file(assets, tmp_path, monkeypatch, capsys):
    tiny, data = assets
    out = tmp_path / "res.json"
    full_disk(monkeypatch, f".res.json.tmp-{__import__('os').getpid()}")
    assert main(["eval", "--model", str(tiny), "--data", str(data), "--output", str(out),
                 "--no-cache", "--max-length", "32"]) == 2
    assert "could not write" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither a 0-byte file nor a temporary one


def test_an_unwritable_cache_is_named(assets, tmp_path, capsys):
    tiny, data = assets
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["eval", "--model", str(tiny), "--data", str(data), "--cache-dir",
                 str(blocker / "cache"), "--max-length", "32"]) == 2
    err = capsys.readouterr().err
    assert "could not write the cache in" in err and "BIGBATCH_CACHE" in err and "--no-cache" in err


# ---------------------------------------------------------------- damaged model or checkpoint files
@pytest.mark.parametrize("name, text, why", [
    ("config.json", "{not json", "not valid JSON"),
    ("sentence_bert_config.json", "[" * 3000 + "]" * 3000, "expected a JSON object|nested too deep"),
    ("sentence_bert_config.json", '{"max_seq_length": "long"}', "max_seq_length must be a positive"),
])
def test_a_damaged_json_file_of_a_model_folder_is_named(assets, tmp_path, capsys, name, text, why):
    tiny, data = assets
    model = shutil.copytree(tiny, tmp_path / "model")
    (model / name).write_text(text)
    assert main(["eval", "--model", str(model), "--data", str(data), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert f"{model / name}:" in err and __import__("re").search(why, err), err


def test_a_damaged_checkpoint_config_is_named(assets, tmp_path):
    out = tmp_path / "run"
    train(config(assets, out, save_steps=1))
    ckpt = out / "checkpoint-000002"
    (ckpt / "config.yaml").write_text("a: [unclosed\n")
    from bigbatch.train.checkpoint import write_manifest
    write_manifest(ckpt)  # intact by its manifest, damaged inside
    with pytest.raises(ConfigError, match=r"checkpoint-000002/config.yaml: not valid YAML"):
        train(config(assets, out, max_steps=3, resume=str(ckpt)))


# ---------------------------------------------------------------- steps that cannot teach
def test_a_step_of_zero_loss_and_gradient_is_warned_about_and_strict_stops(assets, tmp_path,
                                                                           capsys, monkeypatch):
    from bigbatch.train import loop

    data = tmp_path / "same.jsonl"
    data.write_text("".join(json.dumps({"query": f"q{i}", "positive": "the only document"}) + "\n"
                            for i in range(16)))
    # every step futile: the run trains nothing, which the check at its end says
    with pytest.raises(ConfigError, match="training changed nothing"):
        train(config(assets, tmp_path / "a0", train_data=str(data)))
    assert "warning: step 1: its loss and gradient are 0" in capsys.readouterr().out
    # (that check left out) the summary counts the futile steps
    monkeypatch.setattr(loop, "check_final", lambda *args: "bigbatch train: not checked")
    summary = train(config(assets, tmp_path / "a", train_data=str(data)))
    assert summary["futile_steps"] == {"zero": 2}
    with pytest.raises(ConfigError, match="--strict: step 1: its loss and gradient are 0"):
        train(config(assets, tmp_path / "b", train_data=str(data), strict=True))


def test_overflowing_logits_are_warned_about(assets, tmp_path, capsys):
    train(config(assets, tmp_path / "run", fixed_temperature=True, temperature=1e-9))
    out = capsys.readouterr().out
    assert "warning: step 1: its loss is" in out and "the logits overflow" in out, out[-800:]
    assert "give a --temperature of 0.01 or more" in out


def test_save_total_limit_zero_is_refused():
    with pytest.raises(ConfigError, match="--save-total-limit: must be >= 1"):
        TrainConfig(model="m", train_data="d", save_total_limit=0).validate()


# ---------------------------------------------------------------- results and evaluation data
def test_result_json_is_strict_json():
    from bigbatch.retrieval.report import json_text

    text = json_text({"ndcg@10": float("nan"), "x": [float("inf"), 1.0]})
    assert json.loads(text) == {"ndcg@10": None, "x": [None, 1.0]}


def _no_embedding(monkeypatch):
    from bigbatch.encoders import TextEncoder

    def refuse(*a, **kw):
        raise AssertionError("embedded before the data was checked")

    monkeypatch.setattr(TextEncoder, "encode", refuse)


@pytest.mark.parametrize("case", ["missing-doc", "no-judgement"])
def test_evaluation_data_is_checked_before_anything_is_embedded(assets, tmp_path, capsys,
                                                                monkeypatch, case):
    tiny, data = assets
    d = shutil.copytree(data, tmp_path / "D")
    rows = (d / "qrels" / "test.tsv").read_text().splitlines()
    if case == "missing-doc":
        rows.append("1\tno-such-doc\t1")
    else:
        rows = rows[:1] + [r.rsplit("\t", 1)[0] + "\t0" for r in rows[1:]]
    (d / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    _no_embedding(monkeypatch)
    for argv in (["eval", "--model", str(tiny), "--data", str(d), "--no-cache"],
                 ["mine", "--model", str(tiny), "--data", str(d), "--split", "test",
                  "--output", str(tmp_path / "m.jsonl"), "--no-cache"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert ("corpus ids of qrels/test.tsv are not in corpus.jsonl" if case == "missing-doc"
                else "no query has a relevant judgement") in err, err


# ---------------------------------------------------------------- a model that is not there
def test_a_mistyped_local_folder_is_no_such_folder(tmp_path, monkeypatch):
    from bigbatch.encoders.source import check_model_source

    (tmp_path / "runs" / "final").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--model: no such folder: runs/finall \(.*runs holds: final\)"):
        check_model_source("runs/finall")


@pytest.mark.parametrize("offline", ["1", ""])
def test_a_hub_name_without_network_fails_at_once(monkeypatch, offline):
    from huggingface_hub import constants

    from bigbatch.encoders.source import check_model_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", bool(offline))
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # nothing answers there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"no-org/no-model is no local folder and is not in the "
                                          r"Hugging Face cache.*HF_HUB_OFFLINE=1"):
        check_model_source("no-org/no-model", hub=True)
    assert time.monotonic() - t0 < 30  # not a minute of retries


def test_compressed_data_files_are_named(tmp_path):
    import gzip

    from bigbatch.data.records.validate import validate_file

    path = tmp_path / "train.jsonl"
    path.write_bytes(gzip.compress(b'{"query": "q", "positive": "p"}\n'))
    n, problems = validate_file(path)
    assert n == 0 and "is gzip-compressed" in problems[0].message and "gunzip" in problems[0].message
    with pytest.raises(DataError, match="is gzip-compressed"):
        from bigbatch.data.records.loader import load_records
        load_records(path)


# ---------------------------------------------------------------- the model's limits and shapes
def test_eval_and_mine_refuse_a_max_length_beyond_the_models_positions(assets, tmp_path, capsys):
    tiny, data = assets
    for argv in (["eval", "--model", str(tiny), "--data", str(data), "--no-cache"],
                 ["mine", "--model", str(tiny), "--data", str(data), "--output",
                  str(tmp_path / "m.jsonl"), "--no-cache"]):
        assert main([*argv, "--max-length", "512"]) == 2
        assert "--max-length: 512 is more than the 128 positions" in capsys.readouterr().err


def test_a_resume_onto_a_model_of_another_width_is_refused(assets, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    tiny, _ = assets
    wide = tmp_path / "wide"
    tok = AutoTokenizer.from_pretrained(tiny)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=48, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=128)).save_pretrained(wide)
    tok.save_pretrained(wide)
    out = tmp_path / "run"
    train(config(assets, out, save_steps=2))
    with pytest.raises(ConfigError, match="--resume: .*checkpoint-000002 was trained from the model"):
        train(config(assets, out, model=str(wide), max_steps=3, resume=str(out)))
