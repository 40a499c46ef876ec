"""The training loop of ``bigbatch train``: a bi-encoder fine-tuned with GradCache, hard
negatives, a learnable temperature, LoRA or full fine-tuning, warmup and cosine schedule,
gradient clipping over model and logit scale, retrieval evaluation during training, atomic
checkpoints with exact resume, and cross-device negatives under torchrun.

A run has four phases, each a method of :class:`Trainer`: build (the parts, from the
configuration, after checking the output folder is the run's to write: see
:mod:`bigbatch.train.outdir`), resume (from a checkpoint, or start afresh), step (one
optimizer step, then its logging, evaluation and checkpoint) and finish (the final
checkpoint, ``final/``, the final evaluation and the summary). :func:`train` runs them in
order; a run stopped by Ctrl-C raises :class:`RunInterrupted`, saying how to continue, and
a run that fails before its first step removes the output folder it created.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import distributed as D
from .._progress import progress_bar
from ..errors import ConfigError
from .build import (DTYPES, build_cache, build_encoder, build_loss, build_optimizer,
                    device_for)
from .checkpoint import (abandon_later_checkpoints, atomic_dir, finished_run, latest_checkpoint,
                         load_checkpoint, recover_output_dir, rotate_checkpoints,
                         save_checkpoint, write_errors)
from .config import TrainConfig
from .corpus import FixedCorpus
from .logging import RunLogger, eval_columns, format_eval_row, plot_metrics
from .memory_check import check_fits, describe, estimate_run_step, free_memory
from .outdir import check_output_dir, claim_output_dir, remove_created
from .ranks import barrier, from_main, gather_rng_states, main_first
from .resume import check_resume_matches, check_resumed_data, check_resumed_step, resume_path
from .runid import new_run_id, run_id_of
from .schedule import make_scheduler

__all__ = ["train", "Trainer", "StepCallback", "RunInterrupted", "base_beats_best"]

# called after each step's logging, evaluation and checkpoint with the step and (a copy of)
# the training state; True ends the run there, as a kill would
StepCallback = Callable[[int, dict[str, Any]], bool]


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (a KeyboardInterrupt): its message says at which step, and how
    to continue (``--resume DIR`` from the last checkpoint) or that there is nothing to
    resume. ``step``: the last step done; ``checkpoint``: the one a resume would load."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        return str(self.args[0])


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


def train(config: TrainConfig, on_step_end: StepCallback | None = None) -> dict[str, Any]:
    """Run training as configured; returns a summary with the base and final metrics (and,
    under ``"encoder"``, the trained encoder).

    ``on_step_end(step, state)``, when given, is called after each step's logging,
    evaluation and checkpoint; returning True ends the run right there, as a kill would (no
    final checkpoint, ``final/`` or summary), and the result is ``{"steps", "stopped",
    "encoder"}``.

    Raises:
        ConfigError, DataError: a bad option, training or evaluation data, or resume, or an
            output folder that holds another run's (or other) files.
        OutputError: a checkpoint or ``final/`` could not be written (a full disk).
        RunInterrupted: Ctrl-C; the message says how to continue.
    """
    trainer = Trainer(config)
    try:
        if (done := trainer.resume()) is not None:
            return done
        trainer.start()
        for batch in trainer.batches.iterate(trainer.state["epoch"], trainer.state["index"]):
            if trainer.state["step"] >= trainer.max_steps:
                break
            trainer.step(batch)
            if on_step_end is not None and on_step_end(trainer.state["step"],
                                                       dict(trainer.state)):
                return trainer.stop()
        return trainer.finish()
    except KeyboardInterrupt as e:
        removed = trainer.abort()
        if isinstance(e, RunInterrupted):
            raise
        raise trainer.interrupted(removed) from e
    except BaseException:
        trainer.abort()
        raise


class Trainer:
    """One training run: its parts (built from the configuration), its state (step, data
    position, best metric) and its phases. Every rank builds one and takes the same
    branches; the main rank alone evaluates, logs and writes files while the others wait.
    """

    # ------------------------------------------------------------------ build
    def __init__(self, config: TrainConfig) -> None:
        from ..data import EpochBatches
        from ..evaluate import LOWER_IS_BETTER, check_beir_split

        config.validate()
        self.config = config
        self.info = info = D.init_distributed(timeout_s=config.dist_timeout)
        self.device = device = device_for(config, info)
        self.out = Path(config.output_dir)
        self.ckpt: Path | None = None
        if config.resume:
            if info.is_main and self.out.is_dir():
                recover_output_dir(self.out)  # what a kill inside atomic_dir left, before any read
            barrier(info)
            self.ckpt = resume_path(config.resume)
        # the folder is the run's to write, checked (by every rank) before anything loads;
        # created, or its contents moved aside (--overwrite), when the run starts writing
        resume_run = run_id_of(self.ckpt) if self.ckpt is not None else None
        self.plan = check_output_dir(self.out, overwrite=config.overwrite, resume=self.ckpt,
                                     resume_run=resume_run)
        self.run_id: str = from_main(self._run_id(resume_run), info)
        self.steps_done = 0  # optimizer steps done by this process
        barrier(info)
        self.records = self._open_records()
        if config.eval_data:  # a bad evaluation set stops the run now, not after training
            check_beir_split(config.eval_data, config.eval_split, config.best_metric)
        if config.grad_cache_chunk > config.batch_size:
            config.grad_cache_chunk = config.batch_size
        self.lower_is_better = config.best_metric.removeprefix("unseen/") in LOWER_IS_BETTER

        random.seed(config.seed)
        torch.manual_seed(config.seed)  # same model (and LoRA) initialisation on every rank
        self.lora_r = 0 if config.full_finetune else config.lora_r
        self.encoder = self._build_encoder()
        self.corpus = FixedCorpus(config, self.records, self.encoder, device, info) \
            if config.doc_negatives == "corpus" else None
        self.loss_fn = build_loss(config, self.corpus, device)
        self.model_params = self.encoder.trainable_parameters()
        self.optimizer = build_optimizer(config, self.model_params, self.loss_fn)
        # clipped together each step
        self.all_params = self.model_params + list(self.loss_fn.parameters())
        self.batches = EpochBatches(self.records, config.batch_size, config.num_hard_negatives,
                                    config.seed, info.rank, info.world_size)
        if len(self.batches) == 0:
            raise ConfigError(f"{len(self.records)} training records are fewer than one global "
                              f"batch ({self.batches.global_batch} = --batch-size x processes)")
        self.max_steps = config.max_steps
        if config.epochs:
            self.max_steps = math.ceil(config.epochs * len(self.batches))
        self.scheduler = make_scheduler(self.optimizer, config.scheduler, config.warmup_steps,
                                        self.max_steps)
        amp = DTYPES[config.dtype]
        self.scaler = torch.amp.GradScaler(device.type) if amp is torch.float16 else None
        self.cache, self.chunk, self.q_chunk = build_cache(config, self.encoder, self.loss_fn,
                                                           self.corpus, self.scaler, device)
        self.state: dict[str, Any] = {
            "step": 0, "epoch": 0, "index": 0, "best": None, "best_step": None, "examples": 0,
            "base_metrics": None, "num_records": len(self.records),
            "train_data": os.path.realpath(config.train_data), "run_id": self.run_id}
        self.logger: RunLogger | None = None
        self.bar: Any = None
        self.columns: list[str] | None = None  # of the evaluation rows printed
        self.last_metrics: dict[str, float] | None = None
        self.last_eval_step = -1

    def _open_records(self) -> Sequence[Any]:
        """The training records, read by index (:func:`~bigbatch.data.record_store.open_records`):
        the main rank validates and indexes the data (once) while the others wait, then
        every rank opens the index (:func:`~bigbatch.train.ranks.main_first`)."""
        from ..data.record_store import open_records

        config = self.config
        return main_first(lambda: open_records(config.train_data, config.train_split,
                                               config.num_hard_negatives, config.data_root),
                          self.info)

    def _run_id(self, resume_run: str | None) -> str:
        """A resumed run keeps its id (for a checkpoint from before run ids, the id of the
        folder it continues in, if any); a new run gets a new one."""
        if self.ckpt is not None:
            own = resume_run or (None if self.plan.move_aside else run_id_of(self.out))
            if own:
                return own
        return new_run_id()

    def _build_encoder(self) -> Any:
        """The encoder, on the device, in training mode, its documents' instructions checked;
        in query-side tuning with the frozen document tower."""
        from ..data.records import check_instructions

        encoder = build_encoder(self.config, self.records, self.lora_r).to(self.device)
        check_instructions(self.records, encoder)  # the data's system prompts (swift) apply
        encoder.train()
        if self.config.mode == "query-side-tune":
            encoder.use_base_doc_tower()  # documents: the frozen initial weights
        return encoder

    # ------------------------------------------------------------------ resume
    def resume(self) -> dict[str, Any] | None:
        """Load ``--resume``'s checkpoint (after checking it continues this run), or seed each
        rank's own dropout stream for a fresh start. Returns the finished run's summary when
        the checkpoint is its last step (nothing left to do), else None.

        Raises:
            ConfigError: no checkpoint there, or it was written with other data settings,
                another number of processes or other training data.
        """
        config, info = self.config, self.info
        if not config.resume:
            torch.manual_seed(config.seed + info.rank)  # each rank its own dropout stream
            return None
        ckpt = self.ckpt
        check_resume_matches(ckpt, config, info)
        self.state = load_checkpoint(ckpt, encoder=self.encoder, loss_fn=self.loss_fn,
                                     optimizer=self.optimizer, scheduler=self.scheduler,
                                     scaler=self.scaler, rank=info.rank)
        check_resumed_data(ckpt, config, len(self.records), self.state)
        check_resumed_step(ckpt, self.state["step"], self.max_steps)
        self.state["num_records"] = len(self.records)
        self.state["train_data"] = os.path.realpath(config.train_data)
        self.state["run_id"] = self.run_id
        self._claim()
        if info.is_main:  # later checkpoints of the timeline left behind would outrank ours
            abandon_later_checkpoints(self.out, self.state["step"])
        if (done := finished_run(self.out, self.state["step"], self.max_steps,
                                 announce=info.is_main, run_id=self.run_id)):
            return {**done, "encoder": self.encoder}  # nothing left: no evaluation, no rewrite
        if info.is_main:
            print(f"bigbatch train: resuming from {ckpt} (step {self.state['step']} of "
                  f"{self.max_steps})", flush=True)
        return None

    def _claim(self) -> None:
        """Make the output folder this run's (create it, or move its contents aside with
        --overwrite; record the run id), on the main rank, before the run writes there."""
        if self.info.is_main:
            claim_output_dir(self.plan, self.run_id)
        barrier(self.info)

    def start(self) -> None:
        """Open the log, write ``config.yaml``, announce the run and, on a fresh start with
        ``--eval-at-start``, evaluate the base model."""
        config, info = self.config, self.info
        if not config.resume:
            self._claim()
        self.logger = RunLogger(self.out, enabled=info.is_main,  # a resume drops rows it redoes
                                resume_step=self.state["step"] if config.resume else None)
        self.step_memory = estimate_run_step(self.cache, self.encoder, self.records, config,
                                             self.device, info.world_size, self.model_params)
        if self.step_memory is not None:  # stop now, with the numbers, rather than at step 1
            check_fits(self.step_memory, free_memory(self.device), self.device)
        if info.is_main:
            config.write(self.out / "config.yaml")
            print(self._announcement(), flush=True)
        self.t_start = time.time()
        if not config.resume and config.eval_at_start:
            self.state["base_metrics"] = self.evaluate(0)
        self.bar = progress_bar(total=self.max_steps, initial=self.state["step"], desc="train",
                                unit="step")
        self.last_eval_step = 0 if self.state["base_metrics"] is not None else -1

    def _announcement(self) -> str:
        config, lora_r = self.config, self.lora_r
        n_train = sum(p.numel() for p in self.model_params)
        chunk, q_chunk = self.chunk, self.q_chunk
        text = (f"bigbatch train: {len(self.records)} records, {len(self.batches)} steps/epoch, "
                f"{self.max_steps} steps, global batch {self.batches.global_batch} "
                f"({self.info.world_size} process(es) x {config.batch_size}), chunk "
                f"{chunk}{f' (queries {q_chunk})' if q_chunk != chunk else ''}, "
                f"k={config.num_hard_negatives}, "
                f"{'LoRA r=' + str(lora_r) if lora_r else 'full fine-tuning'} "
                f"({n_train:,} trainable parameters), {self.encoder.encoder_type} encoder, "
                f"device {self.device}")
        if self.step_memory is not None:
            text += f", {describe(self.step_memory)}"
        if config.mode == "query-side-tune":
            corpus = f": {len(self.corpus.ids):,} documents" if self.corpus is not None else ""
            text += (f", query-side-tune ({config.query_side_backward} backward, "
                     f"{config.doc_negatives} negatives{corpus})")
        return text

    # ------------------------------------------------------------------ evaluate and save
    def evaluate(self, step: int) -> dict[str, float] | None:
        """The main rank's retrieval metrics on ``--eval-data`` (logged and shown), the same
        on every rank; None without evaluation data."""
        from ..evaluate import evaluate_beir

        config = self.config
        if not config.eval_data:
            return None
        metrics = None
        if self.info.is_main:
            metrics = evaluate_beir(self.encoder, config.eval_data, config.eval_split,
                                    batch_size=config.eval_batch_size, device=self.device)
            self.logger.log(step, metrics, kind="eval")
            if self.columns is None:  # a header over the first row; each evaluation a row
                self.columns = eval_columns(metrics, config.best_metric)
                print(format_eval_row(None, metrics, self.columns), flush=True)
            print(format_eval_row(step, metrics, self.columns), flush=True)
        return from_main(metrics, self.info)  # every rank takes the same branches after it

    def save(self, path: Path) -> None:
        """Write a checkpoint (every rank's random state; the main rank writes)."""
        states = gather_rng_states(self.info)
        if self.info.is_main:
            save_checkpoint(path, encoder=self.encoder, loss_fn=self.loss_fn,
                            optimizer=self.optimizer, scheduler=self.scheduler,
                            scaler=self.scaler, state=dict(self.state), config=self.config,
                            rank_states=states)
        barrier(self.info)

    def consider_best(self, metrics: dict[str, float] | None, step: int) -> bool:
        """Save ``best/`` when ``metrics`` (the same on every rank) improve on the best so far
        (a NaN never counts as better)."""
        if metrics is None:
            return False
        value = metrics.get(self.config.best_metric)
        if value is None or math.isnan(value):
            return False
        better = _improves(value, self.state["best"], self.lower_is_better)
        if better:
            self.state["best"], self.state["best_step"] = value, step
            self.save(self.out / "best")
        return better

    def _save_step(self, step: int) -> None:
        """Write ``checkpoint-<step>`` and drop the oldest beyond ``--save-total-limit``."""
        self.save(self.out / f"checkpoint-{step:06d}")
        if self.info.is_main:
            rotate_checkpoints(self.out, self.config.save_total_limit, run_id=self.run_id)

    # ------------------------------------------------------------------ step
    def step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on ``batch``, then its logging, evaluation and checkpoint as
        configured. Returns the step's logged values (loss, metrics, lr, grad_norm, ...)."""
        values = self._optimize(batch)
        self.steps_done += 1
        step, config = self.state["step"], self.config
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}",
                             temp=f"{values['temperature']:.4f}",
                             ex_s=f"{values['examples_per_s']:.1f}")
        if step % config.log_steps == 0 or step == self.max_steps:
            self.logger.log(step, values)
        if config.eval_steps and step % config.eval_steps == 0 and step < self.max_steps:
            self.last_metrics = self.evaluate(step)
            self.last_eval_step = step
            self.consider_best(self.last_metrics, step)
        if config.save_steps and step % config.save_steps == 0 and step < self.max_steps:
            self._save_step(step)
        return values

    def _optimize(self, batch: Any) -> dict[str, float]:
        """The gradient of the batch's loss (GradCache), clipped, and the optimizer and
        schedule stepped; advances the state. Returns the values to log."""
        config, encoder, optimizer, scaler = self.config, self.encoder, self.optimizer, \
            self.scaler
        q = encoder.step_inputs(batch.queries, "query", max_length=config.query_max_length)
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        if self.corpus is not None:
            result = self.cache.step(query=q, **self.corpus.targets(batch, self.device))
        else:
            d = encoder.step_inputs(batch.docs, "doc")
            result = self.cache.step(query=q, doc=d, doc_ids=batch.doc_ids)
        if scaler is not None:
            scaler.unscale_(optimizer)
        if config.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.all_params, config.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.all_params
                                                       if p.grad is not None])
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used
        self.scheduler.step()
        self.loss_fn.clamp_()
        n = self.batches.global_batch
        self.state["step"] += 1
        self.state["epoch"], self.state["index"] = batch.epoch, batch.index + 1
        self.state["examples"] += n
        values = result.to_dict()
        values.update(lr=lr, grad_norm=float(grad_norm),
                      epoch=batch.epoch + (batch.index + 1) / len(self.batches),
                      examples_per_s=n / max(time.time() - t0, 1e-9))
        return values

    # ------------------------------------------------------------------ finish
    def stop(self) -> dict[str, Any]:
        """End the run here, as a kill would: nothing more is written."""
        self.bar.close()
        self.logger.close()
        return {"steps": self.state["step"], "stopped": True, "encoder": self.encoder}

    def abort(self) -> bool:
        """After a failure or Ctrl-C: close the progress bar and the logs, and remove the
        output folder when this run created it and did no step (nothing in it is worth
        keeping, and a new start may use the folder). Returns whether it was removed."""
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:
            self.logger.close()
        if self.info.is_main and self.steps_done == 0 and remove_created(self.plan):
            print(f"bigbatch train: removed {self.out}, which this run had created "
                  f"(it stopped before its first step)", flush=True)
            return True
        return False

    def interrupted(self, removed: bool = False) -> RunInterrupted:
        """The :class:`RunInterrupted` of a run stopped here: at which step, and how to go on
        (``removed``: the output folder was removed, nothing was written)."""
        step, out = self.state["step"], self.out
        ckpt = None if removed else latest_checkpoint(out, self.run_id) if out.is_dir() else None
        if removed:
            text = "stopped before step 1; nothing was written"
        elif ckpt is not None:
            at = int(ckpt.name.rsplit("-", 1)[1])
            text = (f"stopped at step {step}; continue with --resume {out} (from "
                    f"{ckpt.name}" + (f", redoing steps {at + 1}-{step})" if at < step else ")"))
        else:
            text = (f"stopped at step {step}, before the first checkpoint (--save-steps "
                    f"{self.config.save_steps}): nothing to resume; start again with "
                    f"--overwrite (moves what {out} holds aside) or a new --output-dir")
        return RunInterrupted(f"bigbatch train: {text}", step, ckpt)

    def finish(self) -> dict[str, Any]:
        """The final checkpoint and ``final/`` (the weights first, so a failing final
        evaluation loses nothing), the final evaluation (which may still make ``best/``), the
        training curves and ``summary.json``. Returns the summary, with the encoder."""
        config, info, out, state = self.config, self.info, self.out, self.state
        self.bar.close()
        self._save_step(state["step"])
        if info.is_main:
            with atomic_dir(out / "final") as tmp, \
                    write_errors(out / "final", f"continue with --resume {out}"):
                self.encoder.save(tmp, merge_lora=config.merge_lora)
        barrier(info)
        if state["step"] >= self.max_steps and self.last_eval_step != state["step"]:
            self.last_metrics = self.evaluate(state["step"])
            if self.consider_best(self.last_metrics, state["step"]):  # the final checkpoint
                self.save(out / f"checkpoint-{state['step']:06d}")    # records it
        if info.is_main:
            if (out / "metrics.jsonl").exists():
                plot_metrics(out / "metrics.jsonl", out / "training_curves.png",
                             eval_keys=tuple(dict.fromkeys(("ndcg@10", "recall@10", "mrr@10",
                                                            config.best_metric))))
            self.logger.close()
        barrier(info)
        return self._summary()

    def _summary(self) -> dict[str, Any]:
        """The run's summary (written to ``summary.json`` by the main rank), noting a base
        model that beat every evaluated step."""
        state, out = self.state, self.out
        summary = {"steps": state["step"], "seconds": time.time() - self.t_start,
                   "base": state["base_metrics"], "final": self.last_metrics,
                   "best": state["best"], "best_step": state["best_step"],
                   "output_dir": str(out), "final_model": str(out / "final"),
                   "run_id": self.run_id}
        note = base_beats_best(state["base_metrics"], state["best"], state["best_step"],
                               self.config.best_metric, self.lower_is_better)
        if note:
            summary["base_beats_best"] = True
            if self.info.is_main:
                print(f"bigbatch train: note: {note}", flush=True)
        if self.info.is_main:
            import json
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        summary["encoder"] = self.encoder
        return summary
