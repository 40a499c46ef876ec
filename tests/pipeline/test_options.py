"""One home per option: each TrainConfig field holds its help, section and choices; flags and
YAML keys are read by one value parser; eval and mine take the model folder options from the
same fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import yaml

from bigbatch.cli import build_parser, main
from bigbatch.errors import ConfigError
from bigbatch.train.config import POOLINGS, SECTIONS, TrainConfig, load_config, one_of

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _sub(name):
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _from_flags(*argv):
    args = build_parser().parse_args(["train", "--model", "m", "--train-data", "d", *argv])
    return load_config(None, {k: v for k, v in vars(args).items()
                              if k not in ("command", "config")})


def _from_yaml(tmp_path, key, value):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": "m", "train_data": "d", key: value}, sort_keys=False))
    return load_config(f)


def test_every_option_has_its_help_and_section_and_no_dead_field():
    assert "extra" not in FIELDS
    for f in FIELDS.values():
        assert f.metadata["help"].strip(), f.name
        assert f.metadata["section"] in SECTIONS, f.name
    groups = {g.title: g for g in _sub("train")._action_groups}
    for section in SECTIONS:
        flags = [a.dest for a in groups[f"{section} options"]._group_actions]
        assert flags == [f.name for f in FIELDS.values() if f.metadata["section"] == section]


@pytest.mark.parametrize("key,text,yaml_value,expected", [
    ("batch_size", "8", 8, 8),
    ("lr", "3e-5", "3e-5", 3e-5),                 # YAML reads 3e-5 as a string
    ("epochs", "2", 2, 2.0),                      # an integer for a number
    ("lora_target_modules", "query,value", "query,value", ["query", "value"]),
    ("lora_target_modules", "query", ["query"], ["query"]),
    ("matryoshka_dims", "32,8", [32, 8], [32, 8]),
    ("extra_negatives", "qq,dd", ["qq", "dd"], ["qq", "dd"]),
    ("loss_block_size", "256", 256, 256),
    ("query_prefix", "q: ", "q: ", "q: "),
])
def test_a_flag_and_a_yaml_key_give_the_same_typed_value(tmp_path, key, text, yaml_value,
                                                          expected):
    flag = "--" + key.replace("_", "-")
    by_flag, by_yaml = getattr(_from_flags(flag, text), key), getattr(
        _from_yaml(tmp_path, key, yaml_value), key)
    assert by_flag == by_yaml == expected
    assert type(by_flag) is type(by_yaml) is type(expected)


@pytest.mark.parametrize("key,text", [("batch_size", "many"), ("lr", "fast"),
                                      ("matryoshka_dims", "32,x"), ("batch_size", "8.5")])
def test_a_bad_value_gives_the_same_error_from_a_flag_and_yaml(tmp_path, capsys, key, text):
    flag = "--" + key.replace("_", "-")
    with pytest.raises(ConfigError) as from_yaml:
        _from_yaml(tmp_path, key, text)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "m", "--train-data", "d", flag, text])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    why = str(from_yaml.value).split(f": {key}", 1)[1].lstrip(": ")
    assert said == f"bigbatch train: error: argument {flag}: {why}"


def test_validate_and_the_flags_name_the_same_choices():
    """Each option with choices: its train flag lists them, validate accepts each and refuses
    another value with the same list."""
    train = {a.dest: a for a in _sub("train")._actions}
    with_choices = {name: f.metadata["choices"] for name, f in FIELDS.items()
                    if f.metadata["choices"]}
    assert {"pooling", "scheduler", "dtype", "encoder", "mode", "query_side_backward",
            "doc_negatives"} <= set(with_choices)
    for name, choices in with_choices.items():
        assert train[name].metavar == "{" + ",".join(choices) + "}"
        for value in choices:
            assert getattr(_valid(name, value), name) == value
        with pytest.raises(ConfigError, match=f"^--{name.replace('_', '-')}: "
                                              f"{one_of(choices)}".replace("(", r"\(")
                                              .replace(")", r"\)")):
            TrainConfig(model="m", train_data="d", **{name: "nonsense"}).validate()


def _valid(name, value):
    """A validated config with ``name`` = ``value`` (and what that value needs)."""
    needs = {("doc_negatives", "corpus"): {"mode": "query-side-tune"},
             ("query_side_backward", "gradcache"): {"mode": "query-side-tune"}}
    return TrainConfig(model="m", train_data="d", **{name: value},
                       **needs.get((name, value), {})).validate()


@pytest.mark.parametrize("command", ["eval", "mine"])
def test_eval_and_mine_take_the_model_folder_options_of_train(command, capsys):
    """Their encoder flags are the train fields whose default is what the model folder says:
    same flags, help and choices (--pooling multivector among them); left out, None."""
    sub, train = _sub(command), {a.dest: a for a in _sub("train")._actions}
    folder = [name for name, f in FIELDS.items() if f.metadata["from_model_folder"]]
    assert folder == ["pooling", "max_length", "query_prefix", "doc_prefix",
                      "query_instruction", "doc_instruction", "max_num_visual_tokens",
                      "min_num_visual_tokens"]
    actions = {a.dest: a for a in sub._actions}
    for name in folder:
        assert actions[name].option_strings == train[name].option_strings
        assert actions[name].help == train[name].help and actions[name].default is None
    assert tuple(actions["pooling"].choices) == POOLINGS
    required = ["--model", "m", "--data", "d"] + (["--output", "o.jsonl"] if command == "mine"
                                                    else [])
    args = sub.parse_args([*required, "--pooling", "multivector", "--max-length", "64"])
    assert (args.pooling, args.max_length, args.batch_size) == ("multivector", 64, 64)
    with pytest.raises(SystemExit):
        main([command, *required, "--pooling", "max"])
    assert "invalid choice: 'max'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--pooling: must be one of"):
        TrainConfig(model="m", train_data="d", pooling="max").validate()
    assert "not train's --batch-size" in actions["batch_size"].help
