"""``bigbatch train`` reporting: ``--report-to`` (TensorBoard, Weights & Biases offline,
none), the model card ``README.md`` in ``final/`` and ``best/`` with the run's real figures
(the saved folder still loads in sentence-transformers), and ``--push-to-hub`` against a
local stand-in of the upload (never the network)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=3, max_steps=4, warmup_steps=1, save_steps=0, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, lr=1e-3, max_length=48, seed=3)
    base.update(kw)
    return TrainConfig(**base).validate()


class FakeHub:
    """A local stand-in of huggingface_hub's HfApi.create_repo and upload_folder."""

    def __init__(self, root: Path, fail: bool = False) -> None:
        self.root, self.fail, self.calls = root, fail, []

    def install(self, monkeypatch):
        import huggingface_hub

        hub = self

        def create_repo(api, repo_id, repo_type=None, exist_ok=False, **kw):
            hub.calls.append(("create_repo", repo_id, exist_ok))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(api, folder_path, repo_id, repo_type=None, commit_message=None, **kw):
            hub.calls.append(("upload_folder", repo_id, commit_message))
            if hub.fail:
                raise OSError("no network here")
            shutil.copytree(folder_path, hub.root / repo_id)

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        return self


@pytest.fixture(scope="module")
def run(assets, tmp_path_factory):
    """One run: evaluations at steps 0, 1 and 2, TensorBoard and W&B (offline), pushed."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("reporting")
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_DIR", str(root / "wandb-home"))
    mp.setenv("WANDB_SILENT", "true")
    hub = FakeHub(root / "hub").install(mp)
    out = root / "run"
    try:
        summary = train(config(assets, out, eval_data=str(assets[1]), eval_steps=1, max_steps=2,
                               eval_at_start=True, report_to=["tensorboard", "wandb"],
                               push_to_hub="me/tiny-bigbatch"))
    finally:
        mp.undo()
    return summary, out, hub


def test_wandb_offline_and_tensorboard_get_the_metrics(run):
    _, out, _ = run
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((out / "wandb").iterdir())
    blob = files[0].read_bytes()
    for key in (b"train/loss", b"train/temperature", b"eval/ndcg@10"):
        assert key in blob, key
    assert any((out / "tensorboard").iterdir())


def card_rows(text, header_start):
    """The rows of the markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("*") for c in line.strip("|").split("|")])
    return rows


def test_the_card_shows_the_runs_real_figures(run):
    summary, out, _ = run
    card = (out / "final" / "README.md").read_text()
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    last_train = [r for r in rows if r["kind"] == "train"][-1]
    table = card_rows(card, "| Step | ndcg@10")
    assert [r[0] for r in table] == ["0 (base)", "1", "2"]
    assert table[0][1] == f"{summary['base']['ndcg@10']:.4f}"
    assert table[-1][1:] == [f"{summary['final'][k]:.4f}" for k in
                             ("ndcg@10", "recall@1", "recall@10", "mrr@10", "unseen/ndcg@10")]
    assert table[1][4] == f"{evals[1]['mrr@10']:.4f}"
    assert "| **2** |" in card  # the saved model's row
    logs = card_rows(card, "| Epoch | Step | Training Loss")
    assert logs[-1][1:3] == ["2", f"{last_train['loss']:.4f}"]
    assert f"temperature {last_train['temperature']:.4f}" in card
    assert '"final_temperature": ' + str(round(last_train["temperature"], 6)) in card
    assert "64 training samples" in card and "32 dimensions" in card
    assert "library_name: sentence-transformers" in card and "- peft" in card
    assert "SentenceTransformer('me/tiny-bigbatch')" in card  # usage names the pushed repo
    # final/ holds the merged weights, the adapter in final/adapter/ for peft
    assert "PeftModel.from_pretrained" in card and "subfolder='adapter'" in card


def test_best_has_its_own_card(run):
    summary, out, _ = run
    step = summary["best_step"]
    for folder in (out / "best", out / "best" / "model"):
        card = (folder / "README.md").read_text()
        assert f"the best checkpoint by `ndcg@10` (step {step})" in card
        table = card_rows(card, "| Step | ndcg@10")
        assert int(table[-1][0]) <= step  # evaluations up to the saved step only


def test_the_saved_folder_still_loads_in_sentence_transformers(run):
    import torch
    from sentence_transformers import SentenceTransformer

    from bigbatch.encoders import load_encoder

    _, out, _ = run
    texts = ["a query about cells", "a document on protein folding"]
    st = SentenceTransformer(str(out / "final"), device="cpu")
    got = st.encode(texts, convert_to_tensor=True)
    ref = load_encoder(out / "final").eval().encode(texts, "doc")
    assert torch.allclose(got.float(), ref.float(), atol=1e-5)


def test_pushed_to_the_stand_in_hub(run):
    summary, out, hub = run
    assert summary["push_to_hub"] == {"repo": "me/tiny-bigbatch",
                                      "url": "https://huggingface.co/me/tiny-bigbatch"}
    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][2] is True  # exist_ok: a second push updates the repository
    uploaded = hub.root / "me" / "tiny-bigbatch"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(
        p.name for p in (out / "final").iterdir())
    assert (uploaded / "README.md").read_text() == (out / "final" / "README.md").read_text()


def test_a_failed_push_keeps_the_run_and_says_how_to_retry(assets, tmp_path, monkeypatch,
                                                           capsys):
    hub = FakeHub(tmp_path / "hub", fail=True).install(monkeypatch)
    out = tmp_path / "run"
    summary = train(config(assets, out, max_steps=1, report_to=["none"],
                           push_to_hub="me/tiny"))
    assert summary["push_to_hub"]["error"] == "OSError: no network here"
    assert "`hf upload me/tiny " in capsys.readouterr().out  # huggingface_hub's hf command
    assert (out / "final" / "README.md").exists() and len(hub.calls) == 2
    assert not (out / "tensorboard").exists()  # --report-to none: metrics.jsonl alone
    assert (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("kw, words", [
    (dict(report_to=["tensorbord"]), "unknown \\['tensorbord'\\]"),
    (dict(report_to=["none", "wandb"]), "'none' cannot be combined"),
    (dict(push_to_hub="a/b/c"), "--push-to-hub: must be a Hub repository id"),
])
def test_bad_reporting_options(assets, tmp_path, kw, words):
    with pytest.raises(ConfigError, match=words):
        config(assets, tmp_path / "run", **kw)


def test_wandb_missing_is_refused_before_the_run(assets, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=re.escape("pip install wandb, or in a bigbatch clone "
                                                    "pip install -e '.[wandb]'")):
        config(assets, tmp_path / "run", report_to=["wandb"])
