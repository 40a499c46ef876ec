"""The training loop of ``bigbatch train``: a bi-encoder fine-tuned with GradCache, hard
negatives, a learnable temperature, LoRA or full fine-tuning, warmup and cosine schedule,
gradient clipping over model and logit scale, retrieval evaluation during training, atomic
checkpoints with exact resume, and cross-device negatives under torchrun.
"""

from __future__ import annotations

import math
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .. import distributed as D
from .._progress import progress_bar
from ..cache import GradCache
from ..errors import ConfigError
from ..losses import CorpusInfoNCE, InfoNCE
from .checkpoint import (abandon_later_checkpoints, atomic_dir, finished_run,
                         latest_checkpoint, load_checkpoint, recover_output_dir, rng_state,
                         rotate_checkpoints, save_checkpoint)
from .config import TrainConfig, model_positions
from .logging import RunLogger, plot_metrics
from .schedule import make_scheduler

__all__ = ["train"]

_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(config: TrainConfig, info: D.WorldInfo) -> torch.device:
    if config.device:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def _resume_path(resume: str) -> Path:
    p = Path(resume)
    if (p / "trainer_state.pt").exists():
        return p
    latest = latest_checkpoint(p) if p.is_dir() else None
    if latest is None:
        raise ConfigError(f"--resume: no checkpoint found at {p}")
    return latest


# settings that decide which records each step reads: a resume must keep them
# (train_data is compared by the resolved path the checkpoint's state records)
_DATA_KEYS = ("train_split", "batch_size", "num_hard_negatives", "seed")


def _check_resume_matches(ckpt: Path, config: TrainConfig, info: D.WorldInfo) -> None:
    """Refuse to resume from a checkpoint written with other data settings, another number of
    processes or other training records: its data position (epoch, batch index) would then
    name other records, and the run would silently skip or repeat some."""
    import yaml

    saved_file = ckpt / "config.yaml"
    saved = yaml.safe_load(saved_file.read_text()) if saved_file.exists() else {}
    for key in _DATA_KEYS:
        now = getattr(config, key)
        if saved.get(key, now) != now:
            raise ConfigError(f"--resume: {ckpt} was written with {key}={saved[key]!r}, this run "
                              f"has {getattr(config, key)!r}; the saved data position would "
                              f"name other records. Resume with the same {key}")
    ranks = len(list(ckpt.glob("rng_state_rank*.pt")))
    if ranks and ranks != info.world_size:
        raise ConfigError(f"--resume: {ckpt} was written by {ranks} process(es), this run has "
                          f"{info.world_size}; resume with the same number of processes")


def _check_resumed_data(ckpt: Path, config: TrainConfig, num_records: int,
                        state: dict[str, Any]) -> None:
    """After loading: the checkpoint's state must name the same training file (resolved
    path) and record count as this run."""
    saved_train_data, saved_num_records = state.get("train_data"), state.get("num_records")
    if saved_train_data is not None and saved_train_data != os.path.realpath(config.train_data):
        raise ConfigError(f"--resume: {ckpt} was trained on {saved_train_data}, this run reads "
                          f"{os.path.realpath(config.train_data)}; resume with the same data")
    if saved_num_records is not None and saved_num_records != num_records:
        raise ConfigError(f"--resume: {ckpt} was trained on {saved_num_records} records, "
                          f"{config.train_data} now holds {num_records}; the data changed")


def _gather_rng_states(info: D.WorldInfo) -> list[dict[str, Any]]:
    mine = rng_state()
    if info.world_size == 1:
        return [mine]
    import torch.distributed as dist

    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states


# how long the other ranks wait while the main rank evaluates, embeds a corpus or writes
# a checkpoint alone: --dist-timeout bounds collectives, not how long an evaluation may take
MAIN_RANK_WAIT = timedelta(days=2)
_wait: list[Any] = [None, None]  # [the default group it was made for, the wait group]


def _wait_group() -> Any:
    """A gloo group over all ranks with a :data:`MAIN_RANK_WAIT` timeout (created once per
    default group, on every rank at the same point: its first use)."""
    import torch.distributed as dist

    if _wait[0] is not dist.group.WORLD:  # holding the group keeps its identity unique
        _wait[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=MAIN_RANK_WAIT)]
    return _wait[1]


def _barrier(info: D.WorldInfo) -> None:
    """Every rank waits here until all arrive, however long the main rank's work took."""
    if info.world_size > 1:
        import torch.distributed as dist
        dist.barrier(group=_wait_group())


def _from_main(obj: Any, info: D.WorldInfo) -> Any:
    """The main rank's ``obj`` on every rank (the others wait as in :func:`_barrier`)."""
    if info.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_wait_group())
    return box[0]


def _check_max_length(config: TrainConfig, model_config: Any) -> None:
    """A max length beyond the model's position embeddings fails inside the model at the
    first long batch, possibly hours in; refuse it now."""
    limit = model_positions(getattr(model_config, "max_position_embeddings", None),
                            getattr(model_config, "model_type", ""))
    if limit is None:
        return
    for name in ("max_length", "query_max_length"):
        value = getattr(config, name)
        if value is not None and value > limit:
            raise ConfigError(f"--{name.replace('_', '-')}: {value} is more than the "
                              f"{limit} positions {config.model} has")


def _build_encoder(config: TrainConfig, records: list, lora_r: int) -> Any:
    """The text or vision-language encoder the configuration asks for."""
    from ..data.images import ImageDoc
    from ..encoders import TextEncoder, VisionLanguageEncoder, is_vision_language_model

    kind = config.encoder
    if kind == "auto":
        kind = "vision-language" if is_vision_language_model(config.model) else "text"
    if kind == "text":
        image = next((r for r in records if isinstance(r.positive, ImageDoc)
                      or any(isinstance(n, ImageDoc) for n in r.negatives)), None)
        if image is not None:
            raise ConfigError(f"{image.source}:{image.line}: the training data has image "
                              f"documents, but --model {config.model} is a text model; use a "
                              f"Qwen2-VL / Qwen2.5-VL / Qwen3-VL model")
        enc = TextEncoder(config.model, pooling=config.pooling, max_length=config.max_length,
                          query_prefix=config.query_prefix, doc_prefix=config.doc_prefix,
                          lora_r=lora_r, lora_alpha=config.lora_alpha,
                          lora_dropout=config.lora_dropout,
                          lora_target_modules=config.lora_target_modules,
                          gradient_checkpointing=config.gradient_checkpointing)
        _check_max_length(config, enc.model.config)
        return enc
    from ..encoders.vision import DOC_INSTRUCTION, QUERY_INSTRUCTION

    return VisionLanguageEncoder(
        config.model, query_instruction=config.query_instruction or QUERY_INSTRUCTION,
        doc_instruction=config.doc_instruction or DOC_INSTRUCTION,
        max_num_visual_tokens=config.max_num_visual_tokens,
        min_num_visual_tokens=config.min_num_visual_tokens, max_length=config.max_length,
        freeze_vision=config.freeze_vision, lora_r=lora_r, lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout, lora_target_modules=config.lora_target_modules,
        gradient_checkpointing=config.gradient_checkpointing)


class _FixedCorpus:
    """Query-side tuning against the whole corpus: every document embedded once by the frozen
    document tower. The corpus is the BEIR directory's ``corpus.jsonl`` when training on one,
    else every distinct document of the training records."""

    def __init__(self, config: TrainConfig, records: list, encoder: Any, device: torch.device,
                 info: D.WorldInfo) -> None:
        from ..data.images import doc_key

        items: list[Any] = []
        keys: list[str] = []  # each item's content key
        self.ids: list[str] = []
        rows: dict[str, list[int]] = {}  # content key -> the corpus rows holding that content

        def add(did: str, doc: Any, key: str) -> None:
            rows.setdefault(key, []).append(len(items))
            self.ids.append(did)
            items.append(doc)
            keys.append(key)

        from ..data.formats import detect_format

        root = Path(config.train_data)
        if root.is_dir() and detect_format(root) == "beir":  # not a datasets folder
            from ..data.beir import load_beir

            for did, doc in load_beir(root, config.train_split).corpus.items():
                add(did, doc, doc_key(doc))
        for r in records:
            if r.positive_key not in rows:
                add(r.positive_id, r.positive, r.positive_key)
            for doc in r.negatives:
                key = doc_key(doc)
                if key not in rows:
                    add(key, doc, key)
        self.rows = rows
        # every row holding a positive of the query (by query id, else by text) is masked out
        # of its negatives, so is a duplicate of it under another corpus id
        self.positives: dict[str, set[int]] = {}
        for r in records:
            self.positives.setdefault(r.query_id or r.query, set()).update(rows[r.positive_key])
        self._query_key = {r.query: r.query_id or r.query for r in records}
        from ..data.corpus import load_embeddings, save_embeddings

        self.cache_file = self._cache_file(encoder, items, keys)
        emb = None
        if not self.cache_file.exists() and info.is_main:
            emb = encoder.encode(items, kind="doc", batch_size=config.eval_batch_size,
                                 device=device, progress="embed training corpus")
            save_embeddings(self.cache_file, self.ids, emb)
        elif self.cache_file.exists() and info.is_main:
            print(f"training corpus embeddings loaded from {self.cache_file}", flush=True)
        _barrier(info)
        cached = load_embeddings(self.cache_file) if emb is None else None
        if cached is not None and cached[0] == self.ids:
            emb = cached[1]
        if emb is None:  # another node's cache, or a stale file: embed here
            emb = encoder.encode(items, kind="doc", batch_size=config.eval_batch_size,
                                 device=device)
        self.emb = emb.to(device)

    def _cache_file(self, encoder: Any, items: list[Any], keys: list[str]) -> Path:
        """Where the frozen tower's corpus embeddings are kept between runs (and resumes):
        keyed by the encoder (files and settings) and every document (text hash, or image
        path, size and modification time)."""
        import hashlib
        import json

        from ..data.corpus import default_cache_dir, encoder_key
        from ..data.images import ImageDoc

        h = hashlib.sha256(json.dumps(encoder_key(encoder), sort_keys=True,
                                      default=str).encode())
        for did, doc, key in zip(self.ids, items, keys):
            h.update(did.encode() + b"\0" + key.encode() + b"\0")
            if isinstance(doc, ImageDoc):
                st = os.stat(doc.path)
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return default_cache_dir() / "embeddings" / f"corpus-{h.hexdigest()[:24]}.pt"

    def targets(self, batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
        pos = [self.rows[key][0] for key in batch.doc_ids]
        pairs = [(row, col) for row, q in enumerate(batch.queries)
                 for col in sorted(self.positives.get(self._query_key.get(q, q), ()))
                 if col != pos[row]]
        other = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        return {"positive_index": torch.tensor(pos, dtype=torch.long, device=device),
                "other_positives": other.to(device)}


def _improves(value: float, best: float | None, lower_is_better: bool) -> bool:
    """Whether ``value`` is better than ``best`` (anything is, when there is none yet)."""
    return best is None or (value < best if lower_is_better else value > best)


def base_beats_best(base: dict[str, float] | None, best: float | None, best_step: int | None,
                    metric: str, lower_is_better: bool) -> str | None:
    """A warning when the model before training scored better on ``metric`` than every
    evaluated step (``best/`` holds the best trained step; the base model is not copied)."""
    value = (base or {}).get(metric)
    if value is None or best is None or math.isnan(value):
        return None
    if _improves(value, best, lower_is_better):
        return (f"the base model scored {metric} {value:.4f} before training, better than "
                f"every evaluated step (best {best:.4f} at step {best_step}, kept in best/); "
                f"training made it worse: try a lower --lr or fewer steps")
    return None


def train(config: TrainConfig, _stop_after: int | None = None) -> dict[str, Any]:
    """Run training as configured; returns a summary with the base and final metrics (and,
    under ``"encoder"``, the trained encoder). ``_stop_after`` ends the run
    right after step N's checkpoint, as a kill would (for resume tests)."""
    from ..data import EpochBatches, load_records
    from ..data.records import check_instructions
    from ..evaluate import LOWER_IS_BETTER, check_beir_split, evaluate_beir

    config.validate()
    info = D.init_distributed(timeout_s=config.dist_timeout)
    device = _device(config, info)
    out = Path(config.output_dir)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        recover_output_dir(out)  # what a kill inside atomic_dir left, before anyone reads it
    _barrier(info)
    records = load_records(config.train_data, config.train_split, config.num_hard_negatives,
                           config.data_root)
    if config.eval_data:  # a bad evaluation set stops the run now, not after training
        check_beir_split(config.eval_data, config.eval_split, config.best_metric)
    if config.grad_cache_chunk > config.batch_size:
        config.grad_cache_chunk = config.batch_size

    random.seed(config.seed)
    torch.manual_seed(config.seed)  # same model (and LoRA) initialisation on every rank
    lora_r = 0 if config.full_finetune else config.lora_r
    encoder = _build_encoder(config, records, lora_r).to(device)
    check_instructions(records, encoder)  # the data's system prompts (swift) are applied
    encoder.train()
    query_side = config.mode == "query-side-tune"
    corpus = None
    if query_side:
        encoder.use_base_doc_tower()  # documents: the frozen initial weights
    if config.doc_negatives == "corpus":
        corpus = _FixedCorpus(config, records, encoder, device, info)
        loss_fn = CorpusInfoNCE(corpus.emb, temperature=config.temperature,
                                learnable_temperature=not config.fixed_temperature).to(device)
    else:
        loss_fn = InfoNCE(temperature=config.temperature,
                          learnable_temperature=not config.fixed_temperature,
                          symmetric=config.symmetric).to(device)
    model_params = encoder.trainable_parameters()
    groups = [{"params": model_params, "weight_decay": config.weight_decay}]
    if list(loss_fn.parameters()):
        groups.append({"params": list(loss_fn.parameters()), "weight_decay": 0.0,
                       "lr": config.logit_scale_lr or config.lr})
    optimizer = torch.optim.AdamW(groups, lr=config.lr)
    all_params = model_params + list(loss_fn.parameters())  # clipped together each step
    batches = EpochBatches(records, config.batch_size, config.num_hard_negatives, config.seed,
                           info.rank, info.world_size)
    if len(batches) == 0:
        raise ConfigError(f"{len(records)} training records are fewer than one global batch "
                          f"({batches.global_batch} = --batch-size x processes)")
    max_steps = config.max_steps
    if config.epochs:
        max_steps = math.ceil(config.epochs * len(batches))
    scheduler = make_scheduler(optimizer, config.scheduler, config.warmup_steps, max_steps)
    amp = _DTYPES[config.dtype]
    scaler = torch.amp.GradScaler(device.type) if amp is torch.float16 else None
    chunk = config.grad_cache_chunk
    q_chunk = min(config.query_grad_cache_chunk or chunk, config.batch_size)
    if query_side and config.query_side_backward == "direct":
        q_chunk = config.batch_size  # one chunk: its graph is kept, backward runs directly
    if corpus is not None:
        towers, chunks = {"query": encoder}, {"query": q_chunk}
    else:
        doc_tower = encoder.frozen_doc_tower() if query_side else encoder
        towers, chunks = {"query": encoder, "doc": doc_tower}, {"query": q_chunk, "doc": chunk}
    collate = encoder.collate_fns()
    if collate is not None:
        collate = {name: collate[name] for name in towers}
    cache = GradCache(towers, loss_fn, chunk_size=chunks, collate_fn=collate,
                      autocast_dtype=amp, scaler=scaler, device=device, sort_by_length=True,
                      cross_device=corpus is None)

    state: dict[str, Any] = {"step": 0, "epoch": 0, "index": 0, "best": None, "best_step": None,
                             "examples": 0, "base_metrics": None, "num_records": len(records),
                             "train_data": os.path.realpath(config.train_data)}
    if config.resume:
        ckpt = _resume_path(config.resume)
        _check_resume_matches(ckpt, config, info)
        state = load_checkpoint(ckpt, encoder=encoder, loss_fn=loss_fn, optimizer=optimizer,
                                scheduler=scheduler, scaler=scaler, rank=info.rank)
        _check_resumed_data(ckpt, config, len(records), state)
        state["num_records"] = len(records)
        state["train_data"] = os.path.realpath(config.train_data)
        if info.is_main:  # later checkpoints of the timeline left behind would outrank ours
            abandon_later_checkpoints(out, state["step"])
        if (done := finished_run(out, state["step"], max_steps, announce=info.is_main)):
            return {**done, "encoder": encoder}  # nothing left: no evaluation, no rewrite
    else:
        torch.manual_seed(config.seed + info.rank)  # each rank its own dropout stream

    logger = RunLogger(out, enabled=info.is_main,  # a resume drops the rows it logs again
                       resume_step=state["step"] if config.resume else None)
    if info.is_main:
        config.write(out / "config.yaml")
        n_train = sum(p.numel() for p in model_params)
        print(f"bigbatch train: {len(records)} records, {len(batches)} steps/epoch, "
              f"{max_steps} steps, global batch {batches.global_batch} "
              f"({info.world_size} process(es) x {config.batch_size}), chunk "
              f"{chunk}{f' (queries {q_chunk})' if q_chunk != chunk else ''}, "
              f"k={config.num_hard_negatives}, "
              f"{'LoRA r=' + str(lora_r) if lora_r else 'full fine-tuning'} "
              f"({n_train:,} trainable parameters), {encoder.kind} encoder, device {device}"
              + (f", query-side-tune ({config.query_side_backward} backward, "
                 f"{config.doc_negatives} negatives"
                 + (f": {len(corpus.ids):,} documents" if corpus is not None else "") + ")"
                 if query_side else ""), flush=True)

    def evaluate(step: int) -> dict[str, float] | None:
        if not config.eval_data:
            return None
        metrics = None
        if info.is_main:
            metrics = evaluate_beir(encoder, config.eval_data, config.eval_split,
                                    batch_size=config.eval_batch_size, device=device)
            logger.log(step, metrics, kind="eval")
            shown = {k: round(v, 4) for k, v in metrics.items() if k in
                     ("ndcg@10", "recall@1", "recall@10", "mrr@10", "unseen/ndcg@10")}
            print(f"eval step {step}: {shown}", flush=True)
        return _from_main(metrics, info)  # every rank takes the same branches after it

    def save(path: Path) -> None:
        states = _gather_rng_states(info)
        if info.is_main:
            save_checkpoint(path, encoder=encoder, loss_fn=loss_fn, optimizer=optimizer,
                            scheduler=scheduler, scaler=scaler, state=dict(state), config=config,
                            rank_states=states)
        _barrier(info)

    lower_is_better = config.best_metric.removeprefix("unseen/") in LOWER_IS_BETTER

    def consider_best(metrics: dict[str, float] | None, step: int) -> bool:
        """Save ``best/`` when ``metrics`` (the same on every rank) improve on the best so far
        (a NaN never counts as better)."""
        if metrics is None:
            return False
        value = metrics.get(config.best_metric)
        if value is None or math.isnan(value):
            return False
        better = _improves(value, state["best"], lower_is_better)
        if better:
            state["best"], state["best_step"] = value, step
            save(out / "best")
        return better

    t_start = time.time()
    if not config.resume and config.eval_at_start:
        state["base_metrics"] = evaluate(0)

    bar = progress_bar(total=max_steps, initial=state["step"], desc="train", unit="step")
    last_eval_step = 0 if state["base_metrics"] is not None else -1
    last_metrics = None
    for batch in batches.iterate(state["epoch"], state["index"]):
        if state["step"] >= max_steps:
            break
        q = encoder.step_inputs(batch.queries, "query", max_length=config.query_max_length)
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        if corpus is not None:
            result = cache.step(query=q, **corpus.targets(batch, device))
        else:
            d = encoder.step_inputs(batch.docs, "doc")
            result = cache.step(query=q, doc=d, doc_ids=batch.doc_ids)
        if scaler is not None:
            scaler.unscale_(optimizer)
        if config.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(all_params, config.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in all_params
                                                       if p.grad is not None])
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        lr = scheduler.get_last_lr()[0]  # the rate this step used
        scheduler.step()
        loss_fn.clamp_()
        state["step"] += 1
        state["epoch"], state["index"] = batch.epoch, batch.index + 1
        state["examples"] += batches.global_batch
        step = state["step"]
        values = result.to_dict()
        values.update(lr=lr, grad_norm=float(grad_norm),
                      epoch=batch.epoch + (batch.index + 1) / len(batches),
                      examples_per_s=batches.global_batch / max(time.time() - t0, 1e-9))
        bar.update(1)
        bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}",
                        temp=f"{values['temperature']:.4f}",
                        ex_s=f"{values['examples_per_s']:.1f}")
        if step % config.log_steps == 0 or step == max_steps:
            logger.log(step, values)
        if config.eval_steps and step % config.eval_steps == 0 and step < max_steps:
            last_metrics = evaluate(step)
            last_eval_step = step
            consider_best(last_metrics, step)
        if config.save_steps and step % config.save_steps == 0 and step < max_steps:
            save(out / f"checkpoint-{step:06d}")
            if info.is_main:
                rotate_checkpoints(out, config.save_total_limit)
        if _stop_after is not None and step >= _stop_after:
            bar.close()
            logger.close()
            return {"steps": step, "stopped": True, "encoder": encoder}
    bar.close()

    # the weights first (checkpoint and final/), so a failing final evaluation loses nothing
    save(out / f"checkpoint-{state['step']:06d}")
    if info.is_main:
        rotate_checkpoints(out, config.save_total_limit)
        with atomic_dir(out / "final") as tmp:
            encoder.save(tmp, merge_lora=config.merge_lora)
    _barrier(info)
    if state["step"] >= max_steps and last_eval_step != state["step"]:
        last_metrics = evaluate(state["step"])
        if consider_best(last_metrics, state["step"]):  # the final checkpoint records it
            save(out / f"checkpoint-{state['step']:06d}")
    if info.is_main:
        if (out / "metrics.jsonl").exists():
            plot_metrics(out / "metrics.jsonl", out / "training_curves.png")
        logger.close()
    _barrier(info)
    summary = {"steps": state["step"], "seconds": time.time() - t_start,
               "base": state["base_metrics"], "final": last_metrics, "best": state["best"],
               "best_step": state["best_step"], "output_dir": str(out),
               "final_model": str(out / "final")}
    note = base_beats_best(state["base_metrics"], state["best"], state["best_step"],
                           config.best_metric, lower_is_better)
    if note:
        summary["base_beats_best"] = True
        if info.is_main:
            print(f"bigbatch train: note: {note}", flush=True)
    if info.is_main:
        import json
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["encoder"] = encoder
    return summary
