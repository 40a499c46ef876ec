"""Config resolution: defaults < YAML < flags; unknown keys and bad values are clear errors."""

from __future__ import annotations

import pytest
import yaml

from bigbatch.cli import build_parser
from bigbatch.errors import ConfigError
from bigbatch.train.config import TrainConfig, load_config


def flags(*argv):
    args = build_parser().parse_args(["train", *argv])
    return args.config, {k: v for k, v in vars(args).items() if k not in ("command", "config")}


def test_defaults_follow_the_seed():
    c = TrainConfig(model="m", train_data="d").validate()
    assert (c.batch_size, c.grad_cache_chunk, c.lr, c.warmup_steps, c.max_steps) == \
        (4, "auto", 2e-5, 50, 500)
    assert (c.temperature, c.num_hard_negatives, c.lora_r, c.lora_alpha, c.max_grad_norm) == \
        (0.07, 0, 32, 32, 1.0)


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": "m", "train-data": "d", "lr": "3e-5", "batch_size": 64,
                                 "lora_target_modules": "query,value", "symmetric": True}))
    path, over = flags("--config", str(f), "--batch-size", "8", "--no-symmetric")
    c = load_config(path, over)
    assert c.lr == 3e-5                       # from the file (a string YAML reads as a number)
    assert c.batch_size == 8                  # the flag wins
    assert c.symmetric is False
    assert c.lora_target_modules == ["query", "value"]
    assert c.grad_cache_chunk == "auto"       # default untouched


@pytest.mark.parametrize("file_keys,argv,expect", [
    # --max-steps typed under a file's epochs: the flag wins (it ran the file's 2 epochs)
    ({"epochs": 2}, ("--max-steps", "3"), (3, None)),
    # --epochs typed under a file's max_steps: the flag wins
    ({"max_steps": 40}, ("--epochs", "1.5"), (40, 1.5)),
    # both in the file: epochs (the documented rule); a flag of either still wins
    ({"epochs": 2, "max_steps": 40}, (), (40, 2.0)),
    ({"epochs": 2, "max_steps": 40}, ("--max-steps", "5"), (5, None)),
    # both on the command line: --epochs, as --help says
    ({}, ("--max-steps", "5", "--epochs", "1"), (5, 1.0)),
])
def test_the_step_budget_follows_command_line_over_file(tmp_path, file_keys, argv, expect):
    """Trap 6 of issue 34: `--max-steps 3 --config demo_colbert.yaml` ran 8 steps, the file's
    `epochs: 2` beating the typed flag."""
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": "m", "train_data": "d", **file_keys}))
    c = load_config(*flags("--config", str(f), *argv))
    assert (c.max_steps, c.epochs) == expect


def test_the_demo_config_with_max_steps_runs_that_many_steps():
    from pathlib import Path

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_colbert.yaml"
    c = load_config(*flags("--config", str(demo), "--model", "m", "--train-data", "d",
                           "--max-steps", "3"))
    assert (c.max_steps, c.epochs) == (3, None)


def test_resolved_config_round_trips(tmp_path):
    c = load_config(None, {"model": "m", "train_data": "d", "epochs": 2.0})
    c.write(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == c


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: m\ntrain_data: d\nbatch_sise: 3\n")
    with pytest.raises(ConfigError,
                       match=r"c.yaml:3: unknown option 'batch_sise'; did you mean 'batch_size'"):
        load_config(f)


@pytest.mark.parametrize("key,value,match", [
    ("batch_size", "many", "batch_size must be an integer"),
    ("lr", "fast", "lr must be a number"),
    ("symmetric", "yes please", "symmetric must be true or false"),
])
def test_bad_yaml_values(tmp_path, key, value, match):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": "m", "train_data": "d", key: value}, sort_keys=False))
    with pytest.raises(ConfigError, match="c.yaml:3: " + match):  # file, line and field
        load_config(f)


@pytest.mark.parametrize("argv,match", [
    (["--grad-cache-chunk", "0"], "--grad-cache-chunk: must be > 0"),
    (["--lr", "-1"], "--lr: must be > 0"),
    (["--scheduler", "linear"], "--scheduler: must be 'cosine' or 'constant'"),
    (["--dtype", "int8"], "--dtype: must be one of"),
    (["--best-metric", "bleu"], "--best-metric"),
    (["--lora-alpha", "0"], "--lora-alpha: 0 means full fine-tuning"),
    # values that used to be accepted, then failed deep inside (or were silently changed)
    (["--temperature", "0.005"], "--temperature: a learnable temperature is kept in"),
    (["--temperature", "2"], "--temperature: a learnable temperature is kept in"),
    (["--logit-scale-lr", "-1"], "--logit-scale-lr: must be > 0"),
    (["--query-max-length", "-5"], "--query-max-length: must be > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout: must be > 0"),
    (["--device", "gpu"], "--device: not a torch device"),
])
def test_bad_flag_values(argv, match):
    path, over = flags("--model", "m", "--train-data", "d", *argv)
    with pytest.raises(ConfigError, match=match):
        load_config(path, over)


def test_required_options_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="--model is required"):
        load_config(None, {"train_data": "d"})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    assert TrainConfig(model="m", train_data="d", lora_r=0, lora_alpha=0).validate().full_finetune


def _st_folder(tmp_path, pooling="pooling_mode_cls_token", extra_module=None):
    """A tiny BERT folder with a sentence-transformers pipeline (CLS pooling, prompts, 96)."""
    import json

    from pipeline_helpers import tiny_bert

    path = tiny_bert(tmp_path / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if extra_module:
        modules.append({"idx": 2, "name": "2", "path": "2_X", "type": extra_module})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, pooling: True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 96}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Represent this sentence: ", "document": ""}}))
    return path


def test_a_sentence_transformers_model_trains_as_it_embeds(tmp_path):
    """Options not given come from the model folder's sentence-transformers configuration,
    as ``bigbatch mine`` / ``eval`` (load_encoder) read them; given ones win."""
    from bigbatch.encoders import load_encoder

    path = _st_folder(tmp_path)
    c = load_config(None, {"model": str(path), "train_data": "d"})
    assert (c.pooling, c.max_length, c.query_prefix, c.doc_prefix) == \
        ("cls", 96, "Represent this sentence: ", "")
    enc = load_encoder(path)
    assert (enc.pooling, enc.max_length, enc.query_prefix) == (c.pooling, c.max_length, c.query_prefix)
    c = load_config(None, {"model": str(path), "train_data": "d", "pooling": "mean",
                           "query_prefix": ""})
    assert (c.pooling, c.max_length, c.query_prefix) == ("mean", 96, "")
    # a plain transformers folder or a hub name keeps the defaults
    assert load_config(None, {"model": "m", "train_data": "d"}).pooling == "mean"


@pytest.mark.parametrize("what", ["dense", "max-pooling"])
def test_a_sentence_transformers_pipeline_bigbatch_cannot_reproduce_is_refused(tmp_path, what):
    from bigbatch.encoders import load_encoder

    path = _st_folder(tmp_path, **({"extra_module": "sentence_transformers.models.Dense"}
                                   if what == "dense" else {"pooling": "pooling_mode_max_tokens"}))
    with pytest.raises(ConfigError, match="Dense" if what == "dense" else "max_tokens"):
        load_encoder(path)
    with pytest.raises(ConfigError, match="explicitly"):
        load_config(None, {"model": str(path), "train_data": "d"})
    given = {k: v for k, v in (("pooling", "cls"), ("max_length", 64), ("query_prefix", ""),
                               ("doc_prefix", ""))}
    assert load_config(None, {"model": str(path), "train_data": "d", **given}).pooling == "cls"


def test_a_fixed_temperature_may_lie_outside_the_learnable_range():
    path, over = flags("--model", "m", "--train-data", "d", "--temperature", "0.005",
                       "--fixed-temperature")
    assert load_config(path, over).temperature == 0.005


@pytest.mark.parametrize("model_type,positions,expected", [("bert", 64, 64), ("roberta", 130, 128),
                                                           ("bert", 512, 256)])
def test_the_default_max_length_fits_the_model(tmp_path, model_type, positions, expected):
    """Left out, --max-length is 256 cut to the model's positions (a model with fewer was
    refused for a value the user never gave); given, it is checked against them."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": model_type, "max_position_embeddings": positions}))
    assert load_config(None, {"model": str(tmp_path), "train_data": "d"}).max_length == expected
    assert load_config(None, {"model": str(tmp_path), "train_data": "d",
                              "max_length": 300}).max_length == 300  # refused at model load


def test_a_home_relative_path_in_yaml_is_expanded(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: ~/m\ntrain_data: ~/data.jsonl\noutput_dir: ~/runs/x\n")
    c = load_config(str(cfg), {})
    assert (c.model, c.train_data, c.output_dir) == \
        (str(tmp_path / "m"), str(tmp_path / "data.jsonl"), str(tmp_path / "runs" / "x"))


def test_resume_auto_is_kept_as_a_word_not_made_a_path(tmp_path):
    """``--resume auto`` (flag or YAML) was resolved like a path, to ``<cwd>/auto``, and a
    run under torchrun then found no checkpoint there; a folder named so is still a path."""
    from bigbatch.train.option_values import resolve_path

    assert resolve_path("resume", "auto", tmp_path) == "auto"
    assert resolve_path("resume", "runs/auto", tmp_path) == str(tmp_path / "runs" / "auto")


@pytest.mark.parametrize("flag, block_size, dense", [(None, None, False), (0, None, True),
                                                      (256, 256, False)])
def test_loss_block_size_reaches_the_loss(flag, block_size, dense):
    """--loss-block-size: unset streams in automatic blocks, 0 is the dense loss."""
    import torch

    from bigbatch.train.build import build_loss

    config = TrainConfig(model="m", train_data="d", loss_block_size=flag)
    loss = build_loss(config, None, torch.device("cpu"))
    assert (loss.block_size, loss.dense) == (block_size, dense)


def test_loss_block_size_must_not_be_negative():
    with pytest.raises(ConfigError, match="--loss-block-size: must be >= 0"):
        TrainConfig(model="m", train_data="d", loss_block_size=-1).validate()
