"""The check at the end of every run (:mod:`bigbatch.train.change_check`): a run that trained
nothing (a learning rate too small for its weights, every parameter frozen by mistake) ends
with a ConfigError, a ``final/`` whose saved weights are not the trained ones with an
OutputError, and a normal run logs the check, also after a resume and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file, save_file

from bigbatch.encoders.base import EncoderBase
from bigbatch.errors import ConfigError, OutputError
from bigbatch.train import TrainConfig, train
from bigbatch.train import loop as loop_module
from bigbatch.train.change_check import distance, sample_indices


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=4, max_steps=3, warmup_steps=0, save_steps=0, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, lr=1e-3, max_length=48, seed=3,
                report_to=["none"])
    base.update(kw)
    return TrainConfig(**base)


def test_a_normal_run_passes_and_logs_the_check(assets, tmp_path, capsys):
    summary = train(config(assets, tmp_path / "run"))
    shown = capsys.readouterr().out
    assert "checked final/: reloaded, it embeds 8 training texts as the trained model does" in \
        shown and "moved from the starting model's by up to" in shown
    assert summary["steps"] == 3 and (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("kw", [{"lr": 1e-30}, {"lr": 1e-30, "lora_r": 0}],
                         ids=["lora", "full"])
def test_a_learning_rate_too_small_to_move_the_weights_ends_with_the_error(assets, tmp_path,
                                                                           capsys, kw):
    """float32 weights (and LoRA's B, starting at 0, moved by 1e-30) change no embedding."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="training changed nothing: the trained model embeds "
                                          "8 training texts as the starting model did"):
        train(config(assets, out, **kw))
    assert "checked final/" not in capsys.readouterr().out
    assert (out / "final").is_dir() and not (out / "summary.json").exists()


def test_every_parameter_frozen_by_mistake_ends_with_the_error(assets, tmp_path, monkeypatch):
    build = loop_module.Trainer._build_encoder

    def frozen(self):  # as a wrapper that froze the model after the adapter was put on it
        return build(self).requires_grad_(False)

    monkeypatch.setattr(loop_module.Trainer, "_build_encoder", frozen)
    with pytest.raises(ConfigError, match=r"LoRA adapter \(0 parameters that require "
                                          r"gradients\) did not move"):
        train(config(assets, tmp_path / "run"))


@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora-lost", "full-altered"])
def test_a_final_folder_whose_saved_weights_are_not_the_trained_ones_is_caught(
        assets, tmp_path, monkeypatch, lora_r):
    """LoRA: a save that lost the adapter (final/ holds the base model's weights); full
    fine-tuning: a save (or a disk) that altered the weights by 5%."""
    tiny, _ = assets
    save_final = EncoderBase.save_final

    def tampered(self, path, keep_adapter=True):
        out = save_final(self, path, keep_adapter)
        weights = load_file(out / "model.safetensors")
        if lora_r:
            base = load_file(tiny / "model.safetensors")
            weights = {k: base[k] for k in weights}
        else:
            weights = {k: v * 1.05 if v.ndim == 2 else v for k, v in weights.items()}
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return out

    monkeypatch.setattr(EncoderBase, "save_final", tampered)
    with pytest.raises(OutputError, match=r"final does not reproduce the trained model: "
                                          r"reloaded, it embeds 8 training texts up to"):
        train(config(assets, tmp_path / "run", lora_r=lora_r))


def test_a_resumed_run_compares_with_the_starting_model_of_the_run(assets, tmp_path, capsys):
    out = tmp_path / "run"
    train(config(assets, out, save_steps=2), on_step_end=lambda step, state: step >= 2)
    capsys.readouterr()
    train(config(assets, out, save_steps=2, resume=str(out)))
    assert "moved from the starting model's by up to" in capsys.readouterr().out


def test_a_run_without_starting_embeddings_says_that_half_was_skipped(assets, tmp_path,
                                                                      capsys, monkeypatch):
    """As a run resumed from a checkpoint written before the check: no silent skip."""
    monkeypatch.setattr(loop_module, "start_state", lambda *args: None)
    train(config(assets, tmp_path / "run"))
    shown = capsys.readouterr().out
    assert "as the trained model does" in shown and \
        "not compared with the starting model's" in shown and "skipped" in shown


def test_the_sample_and_the_distance():
    assert sample_indices(3) == [0, 1, 2] and sample_indices(100) == [0, 33, 66, 99]
    a = [torch.tensor([[3.0, 4.0]], dtype=torch.float64)]
    b = [torch.tensor([[3.0, 4.5]], dtype=torch.float64)]
    assert distance(a, a) == 0.0 and abs(distance(a, b) - 0.5 / float(b[0].norm())) < 1e-12
    assert distance(a, [torch.zeros(1, 3, dtype=torch.float64)]) == float("inf")


def test_under_torchrun_every_rank_ends_with_the_error(assets, tmp_path):
    tiny, data = assets
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "bigbatch.cli", "train", "--model", str(tiny), "--train-data", str(data),
         "--output-dir", str(tmp_path / "run"), "--batch-size", "4", "--grad-cache-chunk", "2",
         "--max-steps", "2", "--warmup-steps", "0", "--save-steps", "0", "--lora-r", "0",
         "--lr", "1e-30", "--max-length", "32", "--no-eval-at-start", "--report-to", "none"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.count("training changed nothing") == 2, proc.stderr[-3000:]
