"""``bigbatch train --fsdp`` under ``torchrun --nproc_per_node=2`` (gloo, float32): the
sharded run follows one process on the global batch (losses, gradient norms, evaluation,
final weights); its checkpoints are written sharded by both processes; ``final/`` loads in
sentence-transformers with the unsharded run's embeddings; a resume on 2 processes is
exact (also after one rank was killed with SIGKILL right after a checkpoint) and one on 1
or 4 processes continues, resharded; bad input is refused before step 1.

The torchrun runs take a minute or more each on 2 shared cores: they are marked slow (the
float64 test of the sharding itself, tests/distributed/test_fsdp.py, runs by default)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.errors import ConfigError

COMMON = ["--max-steps", "2", "--warmup-steps", "1", "--grad-cache-chunk", "3", "--lr", "1e-3",
          "--max-length", "48", "--save-steps", "1", "--seed", "5", "--no-eval-at-start",
          "--report-to", "none"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run(prefix, args, out, check=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    proc = subprocess.run(prefix + ["train", *args, "--output-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rows(out, kind="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run sharded on 2 processes (--batch-size 8) and whole on one (16)."""
    root = tmp_path_factory.mktemp("fsdp_train")
    tiny = tiny_bert(root / "tiny", dropout=0.0)
    data = scifact_slice(root / "sf")
    common = ["--model", str(tiny), "--train-data", str(data), "--lora-r", "0", *COMMON,
              "--eval-data", str(data), "--eval-batch-size", "16"]
    two = run(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli"],
              common + ["--batch-size", "8", "--fsdp"], root / "two")
    run([sys.executable, "-m", "bigbatch.cli"], common + ["--batch-size", "16"], root / "one")
    return {"root": root, "common": common, "two": root / "two", "one": root / "one",
            "printed": two.stdout}


@pytest.mark.slow
def test_fsdp_on_two_processes_follows_one_process(runs):
    two, one = rows(runs["two"]), rows(runs["one"])
    assert "global batch 16 (2 process(es) x 8)" in runs["printed"]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    for r2, r1 in zip(two, one):
        assert abs(r2["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
        assert abs(r2["grad_norm"] - r1["grad_norm"]) <= 1e-5 * r1["grad_norm"]
    # evaluated on both ranks (each its share of the corpus and queries): the same metrics
    (e2,), (e1,) = rows(runs["two"], "eval"), rows(runs["one"], "eval")
    for k in ("ndcg@10", "recall@10", "mrr@10", "pos_sim", "neg_sim"):
        assert abs(e2[k] - e1[k]) <= 1e-6, (k, e2[k], e1[k])
    assert max_diff(weights(runs["two"] / "final"), weights(runs["one"] / "final")) <= 1e-5


@pytest.mark.slow
def test_sharded_checkpoints_hold_every_process_part_and_the_whole_model(runs):
    for folder in (runs["two"] / "checkpoint-000002", runs["two"] / "best"):
        assert len(list((folder / "sharded").glob("*.distcp"))) == 2, folder
        assert (folder / "sharded" / ".metadata").is_file()
        assert json.loads((folder / "sharding.json").read_text())["world_size"] == 2
        assert (folder / "model" / "model.safetensors").is_file()
        assert sorted(p.name for p in folder.glob("rng_state_rank*.pt")) == \
            ["rng_state_rank0.pt", "rng_state_rank1.pt"]
    assert not [p for p in runs["two"].iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.slow
def test_final_of_a_sharded_run_loads_in_sentence_transformers_like_the_unsharded(runs):
    from sentence_transformers import SentenceTransformer

    texts = ["cells divide in tissue", "a query about proteins", "x"]
    two = SentenceTransformer(str(runs["two"] / "final"), device="cpu").encode(
        texts, convert_to_tensor=True)
    one = SentenceTransformer(str(runs["one"] / "final"), device="cpu").encode(
        texts, convert_to_tensor=True)
    assert (two - one).abs().max().item() <= 1e-5


def _resume_copy(runs, name):
    """A copy of the sharded run's folder as a kill right after checkpoint 1 left it."""
    out = runs["root"] / name
    shutil.copytree(runs["two"], out)
    for later in ("checkpoint-000002", "final", "best", "summary.json"):
        p = out / later
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


@pytest.mark.slow
def test_sharded_resume_on_the_same_processes_is_exact(runs):
    out = _resume_copy(runs, "resumed2")
    run(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli"],
        runs["common"] + ["--batch-size", "8", "--fsdp", "--resume", str(out)], out)
    assert max_diff(weights(out / "final"), weights(runs["two"] / "final")) == 0.0


def _children(pid):
    """The pids whose parent is ``pid`` (Linux's /proc)."""
    out = []
    for stat in __import__("pathlib").Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in /proc")
def test_a_rank_killed_right_after_a_sharded_checkpoint_resumes_exactly(runs):
    """SIGKILL of one rank as soon as checkpoint 1 is in place (torchrun then stops the
    other): --resume on 2 processes ends with the uninterrupted run's weights, bit for bit."""
    import signal
    import time

    out = runs["root"] / "killed"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    with open(runs["root"] / "killed.log", "w") as log:
        proc = subprocess.Popen(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli", "train",
                                            *runs["common"], "--batch-size", "8", "--fsdp",
                                            "--output-dir", str(out)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 600
        while not (out / "checkpoint-000001" / "manifest.json").exists():
            assert proc.poll() is None and time.time() < deadline, \
                (runs["root"] / "killed.log").read_text()[-3000:]
            time.sleep(0.02)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        proc.wait(timeout=600)
    assert proc.returncode != 0 and not (out / "final").exists()
    run(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli"],
        runs["common"] + ["--batch-size", "8", "--fsdp", "--resume", str(out)], out)
    assert max_diff(weights(out / "final"), weights(runs["two"] / "final")) == 0.0


@pytest.mark.slow
def test_sharded_resume_on_one_process_continues_resharded(runs):
    out = _resume_copy(runs, "resumed1")
    proc = run(TORCHRUN + ["--nproc_per_node=1", "-m", "bigbatch.cli"],
               runs["common"] + ["--batch-size", "16", "--fsdp", "--resume", str(out)], out)
    assert "resharding checkpoint-000001: written by 2 process(es), continued on 1" in \
        proc.stdout
    assert max_diff(weights(out / "final"), weights(runs["two"] / "final")) <= 1e-5
    assert rows(out)[-1]["step"] == 2


def _sharded_checkpoint(folder, world=2, batch_size=8, lora_r=0, scheme="fsdp2"):
    folder.mkdir(parents=True)
    (folder / "sharding.json").write_text(json.dumps(
        {"scheme": scheme, "world_size": world, "model": "m", "lora_r": lora_r}))
    (folder / "config.yaml").write_text(f"batch_size: {batch_size}\n")
    return folder


@dataclasses.dataclass(frozen=True)
class _Config:  # the options resume_view reads
    fsdp: bool = True
    batch_size: int = 8
    lora_r: int = 0
    deepspeed: str | None = None

    @property
    def full_finetune(self):
        return self.lora_r == 0


def _config(**kw):
    return _Config(**kw)


def test_a_sharded_resume_keeps_the_global_batch_on_another_number_of_processes(tmp_path,
                                                                                capsys):
    from bigbatch.engine.distributed import WorldInfo
    from bigbatch.train.sharded_checkpoint import resume_view

    ckpt = _sharded_checkpoint(tmp_path / "checkpoint-000001")
    same = resume_view(ckpt, _config(), WorldInfo(0, 2, 0))
    assert same[1].world_size == 2 and same[0].batch_size == 8
    # on 1 process with the same global batch: checked as the saved run (2 x 8)
    view, world = resume_view(ckpt, _config(batch_size=16), WorldInfo(0, 1, 0))
    assert (view.batch_size, world.world_size, world.rank) == (8, 2, 0)
    assert "resharding checkpoint-000001: written by 2 process(es), continued on 1" in \
        capsys.readouterr().out
    with pytest.raises(ConfigError, match="Resume with --batch-size 16 so that the global "
                                          "batch stays 16"):
        resume_view(ckpt, _config(batch_size=8), WorldInfo(0, 1, 0))
    with pytest.raises(ConfigError, match="which 3 process.es. cannot split evenly"):
        resume_view(ckpt, _config(batch_size=8), WorldInfo(0, 3, 0))


def test_a_sharded_resume_of_another_scheme_is_refused(tmp_path):
    from bigbatch.engine.distributed import WorldInfo
    from bigbatch.train.sharded_checkpoint import resume_view

    ckpt = _sharded_checkpoint(tmp_path / "sharded")
    info = WorldInfo(0, 2, 0)
    with pytest.raises(ConfigError, match="written by a sharded .--fsdp. run; resume it with "
                                          "--fsdp under torchrun"):
        resume_view(ckpt, _config(fsdp=False), info)
    with pytest.raises(ConfigError, match="fsdp2 run with LoRA rank 0, this run has 8"):
        resume_view(ckpt, _config(lora_r=8), info)
    whole = tmp_path / "whole"
    whole.mkdir()
    with pytest.raises(ConfigError, match="written by a run without --fsdp or --deepspeed "
                                          ".whole weights.; resume it so"):
        resume_view(whole, _config(), info)
    with pytest.raises(ConfigError, match="written by 2 process.es. under --deepspeed, this "
                                          "run has 1"):
        resume_view(_sharded_checkpoint(tmp_path / "ds", scheme="deepspeed"),
                    _config(fsdp=False, deepspeed="ds.json"), WorldInfo(0, 1, 0))


@pytest.mark.parametrize("flags,message", [
    ({"fsdp": True, "deepspeed": "ds.json"}, "--fsdp and --deepspeed both shard the model"),
    ({"fsdp": True, "dtype": "float16"}, "--fsdp runs float32 or bfloat16"),
    ({"fsdp_cpu_offload": True}, "offloads the shards of --fsdp; give --fsdp too"),
])
def test_options_fsdp_cannot_run_with_are_refused(tmp_path, flags, message):
    from bigbatch.train import load_config

    tiny = tiny_bert(tmp_path / "tiny")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    flags = {k: str(tmp_path / v) if k == "deepspeed" else v for k, v in flags.items()}
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"model": str(tiny), "train_data": str(scifact_slice(tmp_path / "sf")),
                           "output_dir": str(tmp_path / "out"), **flags})


def test_fsdp_without_torchrun_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from bigbatch.train import load_config, train

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    tiny = tiny_bert(tmp_path / "tiny")
    config = load_config(None, {"model": str(tiny), "train_data": str(scifact_slice(
        tmp_path / "sf")), "output_dir": str(tmp_path / "out"), "fsdp": True})
    with pytest.raises(ConfigError, match="--fsdp shards the model over the processes of "
                                          "torchrun; start the run with `torchrun"):
        train(config)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1, 2])
def test_two_nodes_follow_one_process_and_only_the_global_main_rank_writes(runs, per_node):
    """Two `torchrun --nnodes 2` launches of ``per_node`` processes each (c10d rendezvous on
    127.0.0.1): each node has its local rank 0, rank 0 of the whole run alone prints and
    writes, and the run (the same global batch of 16) is the one-process run's."""
    from dist_helpers import free_port

    out = runs["root"] / f"nodes{per_node}"
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    launches = [subprocess.Popen(
        TORCHRUN[:-1] + ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                         str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                         "--rdzv-id", f"two-nodes-{per_node}", "-m", "bigbatch.cli", "train",
                         *runs["common"], "--batch-size", str(8 // per_node), "--fsdp",
                         "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for node in (0, 1)]
    printed = [p.communicate(timeout=600) for p in launches]
    for p, (stdout, stderr) in zip(launches, printed):
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
    starts = [stdout.count("bigbatch train: 64 records") for stdout, _ in printed]
    assert sorted(starts) == [0, 1]  # one of the two local ranks 0 is the global main rank
    assert [r["step"] for r in rows(out)] == [1, 2]  # each row written once
    for r2, r1 in zip(rows(out), rows(runs["one"])):
        assert abs(r2["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
    assert max_diff(weights(out / "final"), weights(runs["one"] / "final")) <= 1e-5


@pytest.mark.slow
def test_a_sharded_decoder_with_lora_follows_one_process(runs):
    """The LLM-embedder path: a Qwen3 decoder pooled by its last token, LoRA (merged into
    final/), gradient checkpointing, bfloat16 left out (float32 on CPU)."""
    from sentence_transformers import SentenceTransformer

    from bigbatch.encoders.tiny import build_tiny_text

    qwen3 = build_tiny_text(runs["root"] / "qwen3")
    common = ["--model", str(qwen3), "--train-data", str(runs["root"] / "sf"), *COMMON,
              "--pooling", "last", "--lora-r", "4", "--lora-alpha", "8", "--merge-lora",
              "--gradient-checkpointing", "--query-prefix", "Instruct: find it\nQuery: "]
    run(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli"],
        common + ["--batch-size", "8", "--fsdp"], runs["root"] / "q2")
    run([sys.executable, "-m", "bigbatch.cli"], common + ["--batch-size", "16"],
        runs["root"] / "q1")
    for r2, r1 in zip(rows(runs["root"] / "q2"), rows(runs["root"] / "q1")):
        assert abs(r2["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
    texts = ["cells divide", "x"]
    got, want = (SentenceTransformer(str(runs["root"] / name / "final"), device="cpu").encode(
        texts, prompt_name="query", convert_to_tensor=True) for name in ("q2", "q1"))
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_a_sharded_vision_language_model_follows_one_process(runs):
    """A tiny Qwen3-VL with LoRA on page images, evaluated on a page corpus: its vision
    tower stays in the root unit (text queries and page documents make the same
    collectives on every rank)."""
    from bigbatch.data.tools.pages import render_beir_pages
    from bigbatch.encoders.tiny import build_tiny_vl

    root = runs["root"]
    pages = root / "pages"
    render_beir_pages(scifact_slice(root / "vl_src", n_train=16, n_test=6, n_extra_docs=10),
                      pages, num_negatives=1, size=(224, 224), font_size=9, progress=False)
    model = build_tiny_vl(root / "qwen3_vl", "qwen3_vl")
    common = ["--model", str(model), "--train-data", str(pages / "train.jsonl"), *COMMON,
              "--max-length", "32", "--max-num-visual-tokens", "16", "--lora-r", "4",
              "--lora-alpha", "8", "--grad-cache-chunk", "2", "--eval-data", str(pages),
              "--eval-batch-size", "8"]
    run(TORCHRUN + ["--nproc_per_node=2", "-m", "bigbatch.cli"],
        common + ["--batch-size", "4", "--fsdp"], root / "vl2")
    run([sys.executable, "-m", "bigbatch.cli"], common + ["--batch-size", "8"], root / "vl1")
    for r2, r1 in zip(rows(root / "vl2"), rows(root / "vl1")):
        assert abs(r2["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
    (e2,), (e1,) = rows(root / "vl2", "eval"), rows(root / "vl1", "eval")
    assert abs(e2["ndcg@10"] - e1["ndcg@10"]) <= 1e-6


@pytest.mark.slow
def test_sharded_resume_on_four_processes_continues_resharded(runs):
    out = _resume_copy(runs, "resumed4")
    proc = run(TORCHRUN + ["--nproc_per_node=4", "-m", "bigbatch.cli"],
               runs["common"] + ["--batch-size", "4", "--fsdp", "--resume", str(out)], out)
    assert "resharding checkpoint-000001: written by 2 process(es), continued on 4" in \
        proc.stdout
    assert max_diff(weights(out / "final"), weights(runs["two"] / "final")) <= 1e-5
    assert rows(out)[-1]["step"] == 2
