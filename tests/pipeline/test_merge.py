"""Checkpoint merging: ``bigbatch merge`` (the mean of checkpoints is the tensor mean, slerp's
endpoints are its inputs, a merged LoRA adapter loads in peft and is the adapters' mean,
mismatches and outputs over inputs are refused) and ``bigbatch train --merge-last``, on a
tiny BERT and a SciFact slice."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file, save_file

from bigbatch.cli import main
from bigbatch.encoders import load_encoder
from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train
from bigbatch.train.merge import merge_models, slerp_tensor

TEXTS = ["a protein that binds DNA", "vitamin D and bone density", "tiny models"]


def run_config(tiny, data, out, **kw):
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=4, max_steps=4, warmup_steps=1, save_steps=2, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, lr=1e-3, max_length=48, seed=3,
                save_total_limit=5, report_to=["none"])
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA run and a fully fine-tuned run, each with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("merge")
    tiny, data = tiny_bert(root / "tiny"), scifact_slice(root / "sf")
    train(run_config(tiny, data, root / "lora"))
    train(run_config(tiny, data, root / "full", lora_r=0))
    return {"root": root, "tiny": tiny, "data": data, "lora": root / "lora",
            "full": root / "full"}


def mean_of(*tensors):
    return (sum(t.double() for t in tensors) / len(tensors)).to(tensors[0].dtype)


def test_the_mean_of_two_checkpoints_is_the_tensor_mean_and_loads_as_final_does(runs, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    a, b = runs["full"] / "checkpoint-000002", runs["full"] / "checkpoint-000004"
    report = merge_models([a, b], tmp_path / "m")
    assert report.space == "full" and report.tensors > 0
    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    merged = load_file(tmp_path / "m" / "model.safetensors")
    assert merged.keys() == wa.keys()
    moved = 0
    for k in wa:
        assert torch.equal(merged[k], mean_of(wa[k], wb[k])), k  # exact
        moved += not torch.equal(wa[k], wb[k])
    assert moved > 10  # the two checkpoints differ: the mean is not one of them
    assert not (tmp_path / "m" / ".merge-stage").exists()
    assert json.loads((tmp_path / "m" / "merge.json").read_text())["method"] == "mean"
    # it loads as a run's final/ does: bigbatch, sentence-transformers, transformers
    ours = load_encoder(tmp_path / "m").encode(TEXTS)
    st = torch.tensor(SentenceTransformer(str(tmp_path / "m"), device="cpu").encode(TEXTS))
    assert torch.allclose(ours, st, atol=1e-5)
    AutoModel.from_pretrained(tmp_path / "m")
    # and its bigbatch_encoder.json names the run's base model, not a staging folder
    meta = json.loads((tmp_path / "m" / "bigbatch_encoder.json").read_text())
    assert meta["base_model"] == str(runs["tiny"])


def test_slerp_endpoints_are_the_inputs_and_its_midpoint_keeps_the_arc():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert torch.equal(slerp_tensor(a, b, 0.0), a) and torch.equal(slerp_tensor(a, b, 1.0), b)
    # orthogonal tensors: the midpoint is (a + b) sin(pi/4), of norm sqrt((|a|^2 + |b|^2) / 2)
    x = torch.zeros(4, 4, dtype=torch.float64)
    y = torch.zeros(4, 4, dtype=torch.float64)
    x[0] = 3.0
    y[1] = 4.0
    mid = slerp_tensor(x, y, 0.5)
    assert math.isclose(float(mid.norm()), math.sqrt((36 + 64) / 2), rel_tol=1e-12)
    assert torch.allclose(mid, (x + y) * math.sin(math.pi / 4), atol=1e-12)
    # equal norms: the norm is kept all along the arc (a straight line would shrink it)
    y = y * 3 / 4
    for t in (0.25, 0.5, 0.8):
        assert math.isclose(float(slerp_tensor(x, y, t).norm()), float(x.norm()), rel_tol=1e-12)
    # (anti-)parallel or zero: linear, no division by sin(0)
    assert torch.equal(slerp_tensor(x, 2 * x, 0.5), 1.5 * x)
    assert torch.equal(slerp_tensor(x, torch.zeros_like(x), 0.5), 0.5 * x)


def test_slerp_of_two_checkpoints_at_0_is_the_first(runs, tmp_path):
    a, b = runs["full"] / "checkpoint-000002", runs["full"] / "final"
    assert main(["merge", str(a), str(b), "--output", str(tmp_path / "s"), "--method", "slerp",
                 "--weight", "0"]) == 0
    wa = load_file(a / "model" / "model.safetensors")
    merged = load_file(tmp_path / "s" / "model.safetensors")
    assert all(torch.equal(merged[k], wa[k]) for k in wa)


def test_a_merged_lora_is_the_mean_of_the_adapters_and_loads_in_peft(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModel

    # a checkpoint's adapter and a final/ (through final/adapter/) in adapter space
    a, b = runs["lora"] / "checkpoint-000002", runs["lora"] / "final"
    report = merge_models([a, b], tmp_path / "m")
    assert report.space == "adapter"
    wa = load_file(a / "model" / "adapter_model.safetensors")
    wb = load_file(b / "adapter" / "adapter_model.safetensors")
    merged = load_file(tmp_path / "m" / "adapter" / "adapter_model.safetensors")
    assert merged.keys() == wa.keys() and any(not torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(merged[k], mean_of(wa[k], wb[k])) for k in wa)
    # peft loads the merged adapter on the base; final/-style full weights beside it agree
    base = AutoModel.from_pretrained(runs["tiny"])
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "m" / "adapter")).eval()
    enc = load_encoder(tmp_path / "m")  # the merged full weights, as sentence-transformers reads
    tok = enc.tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = peft_model(**tok).last_hidden_state
    mask = tok["attention_mask"].unsqueeze(-1).float()
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert torch.allclose(pooled, enc.encode(TEXTS), atol=1e-5)
    cfg = json.loads((tmp_path / "m" / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(runs["tiny"]) and cfg["r"] == 4


def test_mismatched_models_are_refused_naming_the_files(runs, tmp_path):
    ckpt = runs["lora"] / "checkpoint-000002"
    # another rank
    other = tmp_path / "r8"
    shutil.copytree(ckpt, other)
    cfg_file = other / "model" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "r": 8}))
    with pytest.raises(ConfigError, match=r"adapter_config\.json has r 8 and .*adapter_config\.json 4"):
        merge_models([ckpt, other], tmp_path / "o1")
    # another base model
    other = tmp_path / "base"
    shutil.copytree(ckpt, other)
    meta_file = other / "model" / "bigbatch_encoder.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()),
                                     "base_model": str(tmp_path)}))
    with pytest.raises(ConfigError, match="same base model"):
        merge_models([ckpt, other], tmp_path / "o2")
    # another shape (a BERT twice as wide inside)
    from transformers import BertConfig, BertModel
    wide = tmp_path / "wide"
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=128,
                         max_position_embeddings=128)).save_pretrained(wide)
    with pytest.raises(ConfigError, match=r"intermediate\.dense\.\w+ is \(128,.*\) in .*wide.* and \(64,"):
        merge_models([runs["full"] / "final", wide], tmp_path / "o3")
    # an integer buffer one save keeps and another leaves out (position_ids) is no weight;
    # a float tensor in one only is
    for extra, ok in ((torch.arange(128, dtype=torch.int64)[None], True),
                      (torch.zeros(3), False)):
        other = tmp_path / f"extra-{ok}"
        shutil.copytree(runs["full"] / "final", other)
        weights = load_file(other / "model.safetensors")
        save_file({**weights, "embeddings.position_ids": extra}, other / "model.safetensors",
                  metadata={"format": "pt"})
        if ok:
            merge_models([runs["full"] / "final", other], tmp_path / "extra-merged")
        else:
            with pytest.raises(ConfigError, match="position_ids in one only"):
                merge_models([runs["full"] / "final", other], tmp_path / "o6")
    # an adapter alone with a full model
    with pytest.raises(ConfigError, match="adapter alone"):
        merge_models([ckpt, runs["full"] / "final"], tmp_path / "o4")
    # weights only as a pickle
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(wide / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="no safetensors weights .*pytorch_model.bin"):
        merge_models([runs["full"] / "final", pickled], tmp_path / "o5")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))


def test_an_output_over_an_input_and_bad_options_are_refused(runs, tmp_path, capsys):
    a, b = runs["full"] / "checkpoint-000002", runs["full"] / "checkpoint-000004"
    before = load_file(a / "model" / "model.safetensors")
    for out, what in ((a, "is the input"), (a / "model" / "x", "lies inside the input"),
                      (runs["full"], "holds the input")):
        with pytest.raises(ConfigError, match=what):
            merge_models([a, b], out)
    assert all(torch.equal(before[k], v) for k, v in
               load_file(a / "model" / "model.safetensors").items())
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        merge_models([a, b], busy)
    for kw, what in (({"method": "slerp", "weight": 1.5}, r"\[0, 1\]"),
                     ({"weight": 0.3}, "--weight is the t of --method slerp"),
                     ({"method": "ties"}, "--method must be one of")):
        with pytest.raises(ConfigError, match=what):
            merge_models([a, b], tmp_path / "o", **kw)
    with pytest.raises(ConfigError, match="slerp interpolates two"):
        merge_models([a, b, runs["full"] / "final"], tmp_path / "o", method="slerp")
    with pytest.raises(ConfigError, match="given twice"):
        merge_models([a, a], tmp_path / "o")
    # the command line: one line, exit 2
    assert main(["merge", str(a), "--output", str(tmp_path / "o")]) == 2
    assert "at least two models" in capsys.readouterr().err


def test_merge_last_averages_the_last_checkpoints_and_evaluates_them(runs, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(run_config(runs["tiny"], runs["data"], out, eval_data=str(runs["data"]),
                               save_steps=1, save_total_limit=3, merge_last=3))
    merged = out / "merged"
    assert summary["merged_model"] == str(merged) and summary["merged"]["ndcg@10"] >= 0
    inputs = [out / f"checkpoint-{s:06d}" / "model" / "adapter_model.safetensors" for s in (2, 3, 4)]
    weights = [load_file(f) for f in inputs]
    got = load_file(merged / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(got[k], mean_of(*(w[k] for w in weights))) for k in got)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows if r["kind"] != "train"] == ["eval", "merged"]
    shown = capsys.readouterr().out
    assert "--merge-last 3: averaged 3 LoRA adapters" in shown and "eval  merged" in shown
    assert json.loads((out / "summary.json").read_text())["merged"]["ndcg@10"] == \
        summary["merged"]["ndcg@10"]


@pytest.mark.parametrize("kw, what", [
    ({"merge_last": 2, "save_steps": 0}, "give --save-steps"),
    ({"merge_last": 3, "save_total_limit": 2}, "--save-total-limit >= 3"),
    ({"merge_last": 4, "save_steps": 2, "max_steps": 4}, "writes 2 checkpoint"),
    ({"merge_last": 1}, "must be >= 2"),
])
def test_merge_last_is_checked_before_step_one(runs, tmp_path, kw, what):
    with pytest.raises(ConfigError, match=what):
        train(run_config(runs["tiny"], runs["data"], tmp_path / "run", **kw))
    assert not (tmp_path / "run").exists()


def test_merge_last_of_an_epochs_run_is_checked_with_its_steps(runs, tmp_path):
    # 64 records, batch 8: 8 steps an epoch; --save-steps 4 writes checkpoints 4 and 8
    with pytest.raises(ConfigError, match="writes 2 checkpoint"):
        train(run_config(runs["tiny"], runs["data"], tmp_path / "run", epochs=1, save_steps=4,
                         merge_last=3))

