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
a run that fails before its first step removes the output folder it created. A run told to
stop by SIGTERM or SIGUSR1 (a preempted job: :mod:`bigbatch.train.preempt`) finishes its
step, writes its checkpoint on every rank together and raises :class:`RunPreempted`;
``--resume auto`` continues the run in ``--output-dir`` from its newest intact checkpoint
(or starts it, when there is none), so that a job restarted as it was started
(``torchrun --max-restarts``, a requeued SLURM job) continues by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._progress import progress_bar
from ..encoders.source import model_identity
from ..engine import distributed as D
from ..engine.sizing import MiB, PeakMemory
from ..errors import ConfigError
from .build import (
    AUTOCAST_DTYPES,
    build_cache,
    build_deepspeed,
    build_encoder,
    build_loss,
    build_optimizer,
    check_matryoshka_width,
    device_for,
)
from .change_check import STATE_KEY as CHANGE_KEY
from .change_check import check_final, start_state
from .checkpoint import (
    abandon_later_checkpoints,
    finished_run,
    latest_checkpoint,
    load_checkpoint,
    recover_output_dir,
    rotate_checkpoints,
    save_checkpoint,
    saved_state,
    write_errors,
)
from .config import TrainConfig
from .corpus_negatives import FixedCorpus
from .guide import Guide
from .logging import RunLogger, eval_columns, format_eval_row, plot_metrics
from .main_rank import barrier, from_main, gather_rng_states
from .memory_check import (
    check_first_step,
    check_fits,
    describe,
    describe_sizes,
    estimate_run_step,
    free_memory,
    plan_run_chunks,
)
from .merge import check_merge_last, merge_last
from .model_memory import describe_model_memory, run_model_memory
from .negative_queue import STATE_KEY, RunQueue
from .outdir import check_output_dir, claim_output_dir, remove_created, run_inputs
from .preempt import PREEMPTED_EXIT, StopSignals
from .refresh import refresh_of
from .resume import (
    auto_resume,
    check_resume_matches,
    check_resumed_base,
    check_resumed_data,
    check_resumed_step,
    resume_path,
)
from .runid import new_run_id, run_id_of
from .schedule import make_scheduler
from .sharded_checkpoint import (
    load_sharded_checkpoint,
    resume_view,
    run_scheme,
    save_sharded_checkpoint,
    save_whole,
)
from .sharding import check_fsdp_launch, clip_gradients, local_shards, shard_encoder
from .sources import ChainedRecords, data_identity, load_sources, mix_state
from .step_checks import StepChecks

__all__ = ["train", "Trainer", "StepCallback", "RunInterrupted", "RunPreempted",
           "base_beats_best"]

# the step values logged again under <value>/<source name> in a mix (one curve per source)
_PER_SOURCE = ("loss", "accuracy", "margin", "pos_sim", "neg_sim", "hard_neg_sim")

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

    exit_code = 130  # the command's exit status (as a shell gives a process stopped by Ctrl-C)

    def __str__(self) -> str:
        return str(self.args[0])


class RunPreempted(RunInterrupted):
    """A run stopped by SIGTERM or SIGUSR1 (``signal``) after finishing a step and writing
    its checkpoint, on every rank; exits with
    :data:`~bigbatch.train.preempt.PREEMPTED_EXIT`."""

    exit_code = PREEMPTED_EXIT

    def __init__(self, message: str, step: int, checkpoint: Path | None, signal: str) -> None:
        super().__init__(message, step, checkpoint)
        self.signal = signal


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
        with StopSignals() as stop:  # SIGTERM, SIGUSR1: noted, acted on after the step
            for batch in trainer.iterate():
                if trainer.state["step"] >= trainer.max_steps:
                    break
                trainer.step(batch)
                if on_step_end is not None and on_step_end(trainer.state["step"],
                                                           dict(trainer.state)):
                    return trainer.stop()
                # every rank asks (one all-reduce of a flag), before the next batch is made
                if trainer.state["step"] < trainer.max_steps and \
                        (received := stop.agreed(trainer.info)) is not None:
                    raise trainer.preempted(received)
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
    branches; every rank evaluates its share, the main rank alone logs and writes files
    (under --fsdp and --deepspeed every rank writes its part of each checkpoint).
    """

    # ------------------------------------------------------------------ build
    def __init__(self, config: TrainConfig) -> None:
        from ..retrieval.evaluate import LOWER_IS_BETTER, check_beir_split

        self.config = config = config.checked()
        self.info = info = D.init_distributed(timeout_s=config.dist_timeout)
        if config.fsdp:  # torchrun's processes, a process group even for one
            self.info = info = check_fsdp_launch(info)
        self.device = device = device_for(config, info)
        self.out = Path(config.output_dir)
        self.ckpt: Path | None = None
        if config.resume == "auto":  # this folder's run, continued if it has a checkpoint
            resume, restart = auto_resume(self.out, announce=info.is_main)
            self.config = config = dataclasses.replace(
                config, resume=resume, overwrite=config.overwrite or restart)
        if config.resume:
            if info.is_main and self.out.is_dir():
                recover_output_dir(self.out)  # what a kill inside atomic_dir left, before any read
            barrier(info)
            self.ckpt = resume_path(config.resume, announce=info.is_main)
        # the folder is the run's to write, checked (by every rank) before anything loads;
        # created, or its contents moved aside (--overwrite), when the run starts writing
        resume_run = run_id_of(self.ckpt) if self.ckpt is not None else None
        self.plan = check_output_dir(self.out, overwrite=config.overwrite, resume=self.ckpt,
                                     resume_run=resume_run, inputs=run_inputs(config))
        self.run_id: str = from_main(self._run_id(resume_run), info)
        self.steps_done = 0  # optimizer steps done by this process
        barrier(info)
        # every source loaded and checked (a bad record names its source) before step 1
        self.batches = load_sources(config, info.rank, info.world_size)
        self.sources = self.batches.sources
        self.source_by_name = {s.name: s for s in self.sources}
        self.records = self.sources[0].records if len(self.sources) == 1 else \
            ChainedRecords([s.records for s in self.sources])
        if config.distill:  # every record needs its teacher scores, before any model loads
            from ..data.records.loader import check_teacher_scores
            for src in self.sources:
                check_teacher_scores(src.records)
        self.eval_sets = config.eval_sets()
        for eval_set in self.eval_sets:  # a bad evaluation set stops the run now, not after
            check_beir_split(eval_set.path, config.eval_split, config.best_metric)
        self.lower_is_better = config.best_metric.removeprefix("unseen/") in LOWER_IS_BETTER

        random.seed(config.seed)
        torch.manual_seed(config.seed)  # same model (and LoRA) initialisation on every rank
        self.lora_r = 0 if config.full_finetune else config.lora_r
        self.encoder = self._build_encoder()
        # --refresh-negatives-every: the batches read each record's latest mined negatives
        self.refresh = refresh_of(config, self.sources, info)
        self.corpus = FixedCorpus(config, self.records, self.encoder, device, info) \
            if config.doc_negatives == "corpus" else None
        if config.fsdp:  # before the optimizer: the parameters become shards
            shard_encoder(self.encoder, device, config.dtype, config.fsdp_cpu_offload)
        self.loss_fn = build_loss(config, self.corpus, device)
        no_in_batch = [s.name for s in self.sources if not s.spec.in_batch_negatives]
        if no_in_batch and not hasattr(self.loss_fn, "in_batch_negatives"):
            raise ConfigError(f"--train-data source(s) {no_in_batch}: in_batch_negatives false "
                              f"needs the InfoNCE loss (not {type(self.loss_fn).__name__})")
        self.model_params = self.encoder.trainable_parameters()
        # --deepspeed: DeepSpeed steps the model; this optimizer keeps the temperature alone
        self.optimizer = build_optimizer(config, [] if config.deepspeed else self.model_params,
                                         self.loss_fn)
        # clipped together each step
        self.all_params = self.model_params + list(self.loss_fn.parameters())
        self.guide = None
        if config.guide_model:
            self.guide = Guide(config, self.records, device, config.eval_batch_size)
        self.max_steps = config.max_steps
        if config.epochs:
            self.max_steps = math.ceil(config.epochs * len(self.batches))
        check_merge_last(config.merge_last, config.save_steps, config.save_total_limit,
                         self.max_steps)  # (--epochs: its steps known now)
        self.scheduler = make_scheduler(self.optimizer, config.scheduler, config.warmup_steps,
                                        self.max_steps)
        amp = AUTOCAST_DTYPES[config.dtype]
        self.scaler = torch.amp.GradScaler(device.type) if amp is torch.float16 else None
        self.engine = build_deepspeed(config, self.encoder, self.model_params, self.max_steps,
                                      info.world_size) if config.deepspeed else None
        self.chunk_plan = None  # --grad-cache-chunk auto: the sizes chosen for the budget
        self.chunks_checked = False  # their first step measured (once a run, resumes too)
        self.cache = build_cache(config, self.encoder, self.loss_fn, self.corpus, self.scaler,
                                 device, self.engine, size=self._size_chunks)
        self.queue = RunQueue(config.negative_queue, info, device, self.sources) \
            if config.negative_queue else None  # earlier steps' documents, extra negatives
        train_data, num_records = data_identity(self.batches)
        self.state: dict[str, Any] = {
            "step": 0, "epoch": 0, "index": 0, "best": None, "best_step": None, "examples": 0,
            "base_metrics": None, "num_records": num_records, "train_data": train_data,
            "run_id": self.run_id, "sources": self.batches.start_positions(),
            "mix": mix_state(self.batches), "base_model": model_identity(config.model),
            "chunks": self._chunk_state()}
        self.logger: RunLogger | None = None
        self.bar: Any = None
        self.columns: list[str] | None = None  # of the evaluation rows printed
        self.last_metrics: dict[str, float] | None = None
        self.last_eval_step = -1
        self.step_checks = StepChecks(config.strict, warn=info.is_main)
        self.merged: dict[str, Any] | None = None  # --merge-last's model and metrics

    def _size_chunks(self, cache: Any) -> None:
        """``auto`` chunk sizes for ``--memory-budget`` (build_cache calls it, once)."""
        self.chunk_plan = plan_run_chunks(cache, self.encoder, self.records, self.config,
                                          self.info.world_size, self.model_params,
                                          self.optimizer,
                                          k=max(s.batches.k for s in self.sources))

    def _chunk_state(self) -> dict[str, Any]:
        """The chunk sizes the engine uses, as a checkpoint keeps them (a resumed ``auto``
        run takes them again, so it resumes exactly)."""
        return {"sizes": dict(self.cache.chunk_sizes), "tokens": dict(self.cache.chunk_tokens),
                "plain": self.chunk_plan is not None and self.chunk_plan.plain,
                "checked": self.chunks_checked}

    def iterate(self) -> Any:
        """The batches from the run's position on (each source's own, and the step that
        decides which source comes next), forever; each carries its source's name. Hard
        negatives due a refresh are mined before the batch that trains on them is made."""
        self._refresh_negatives()
        for _, batch in self.batches.iterate(self.state["step"], self.state["sources"]):
            yield batch
            self._refresh_negatives()  # (before the next batch is made)

    def _refresh_negatives(self) -> None:
        """``--refresh-negatives-every``: mine the negatives of the next steps when due
        (after the step's checkpoint, so a resume there mines them again with the same
        weights); the state keeps them, the log says what it cost and what changed."""
        step = self.state["step"]
        if self.refresh is None or not self.refresh.due(step, self.max_steps):
            return
        values = self.refresh.refresh(step, self.encoder, self.device)
        self.state["negatives"] = self.refresh.state()
        if self.info.is_main:
            self.logger.log(step + 1, {"after_step": step, **values}, kind="refresh")
            print(self.refresh.line(step, values), flush=True)

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
        from ..data.records.loader import check_instructions

        encoder = build_encoder(self.config, self.records, self.lora_r).to(self.device)
        check_matryoshka_width(self.config, encoder)  # and the saved models record the dims
        for src in self.sources:  # each source's prompts, saved with the model as its task
            src.prompts = src.spec.prompts(encoder.encoder_type)
            if len(self.sources) == 1:  # one source: its prompts are the model's own
                for side, value in src.prompts.items():
                    if value is not None:
                        setattr(encoder, encoder.prompt_attrs[side], value)
                src.prompts = {}
            with encoder.using_prompts(**src.prompts):
                check_instructions(src.records, encoder)  # the data's system prompts apply
                if len(self.sources) > 1:
                    encoder.tasks[src.name] = encoder.prompts()
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
        base = model_identity(config.model)  # before any weight is copied from the checkpoint
        check_resumed_base(ckpt, saved_state(ckpt).get("base_model"), base)
        check_resume_matches(ckpt, *resume_view(ckpt, config, info))
        parts = dict(encoder=self.encoder, loss_fn=self.loss_fn, optimizer=self.optimizer,
                     scheduler=self.scheduler, scaler=self.scaler)
        self.state = load_sharded_checkpoint(ckpt, **parts, info=info, seed=config.seed,
                                             engine=self.engine) \
            if run_scheme(config) else load_checkpoint(ckpt, **parts, rank=info.rank)
        queued = self.state.pop(STATE_KEY, None)
        if self.queue is not None:
            self.queue.load_state_dict(queued)
        train_data, num_records = data_identity(self.batches)
        check_resumed_data(ckpt, train_data, num_records, self.state, mix_state(self.batches))
        self.state["base_model"] = base
        check_resumed_step(ckpt, self.state["step"], self.max_steps)
        self.state["num_records"], self.state["train_data"] = num_records, train_data
        if "sources" not in self.state:  # a checkpoint from before mixes: one source
            self.state["sources"] = {self.sources[0].name: [self.state["epoch"],
                                                            self.state["index"]]}
        self.state["mix"] = mix_state(self.batches)
        self.state["run_id"] = self.run_id
        saved = self.state.get("chunks")
        if self.chunk_plan is not None and saved:  # auto: the sizes the run had, not new ones
            self.chunk_plan = self.chunk_plan.at(saved["sizes"], saved["tokens"], saved["plain"])
            self.cache.use_plan(self.chunk_plan)
            self.chunks_checked = bool(saved.get("checked"))
        self.state["chunks"] = self._chunk_state()
        if self.refresh is not None:  # the negatives the run was training on
            self.refresh.load(self.state.get("negatives"), ckpt)
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
            with write_errors(self.out / "run.json", "then start the run again"):
                claim_output_dir(self.plan, self.run_id)
        barrier(self.info)

    def start(self) -> None:
        """Open the log, write ``config.yaml``, announce the run and, on a fresh start with
        ``--eval-at-start``, evaluate the base model."""
        config, info = self.config, self.info
        if not config.resume:
            self._claim()
        self.logger = RunLogger(self.out, enabled=info.is_main,  # a resume drops rows it redoes
                                resume_step=self.state["step"] if config.resume else None,
                                report_to=config.report_to, name=self.out.name,
                                settings={**config.to_dict(), "run_id": self.run_id})
        # (under DeepSpeed the probe's backward would go through the engine: not estimated)
        if self.chunk_plan is not None:  # auto: the estimate the sizes were chosen by
            self.step_memory = self.chunk_plan.memory
        else:
            self.step_memory = None if self.engine is not None else estimate_run_step(
                self.cache, self.encoder, self.records, config, self.device, info.world_size,
                local_shards(self.model_params), k=max(s.batches.k for s in self.sources))
        if self.step_memory is not None:  # stop now, with the numbers, rather than at step 1
            check_fits(self.step_memory, free_memory(self.device), self.device)
        if info.is_main:
            with write_errors(self.out / "config.yaml", "then start the run again"):
                config.write(self.out / "config.yaml")
            print(self._announcement(), flush=True)
        self.t_start = time.time()
        if not config.resume and config.eval_at_start:
            self.state["base_metrics"] = self.evaluate(0)
        if not config.resume:  # the starting model's embeddings of a few training texts
            self.state[CHANGE_KEY] = start_state(self.encoder, self.records,
                                                 config.eval_batch_size, self.device)
        self.bar = progress_bar(total=self.max_steps, initial=self.state["step"], desc="train",
                                unit="step")
        self.last_eval_step = 0 if self.state["base_metrics"] is not None else -1

    def _announcement(self) -> str:
        config, lora_r = self.config, self.lora_r
        n_train = sum(getattr(p, "ds_numel", p.numel()) for p in self.model_params)  # (ZeRO-3)
        sizes = describe_sizes(self.chunk_plan, self.cache.chunk_sizes,  # as the engine
                               self.cache.chunk_tokens)                  # uses them
        mix = "" if len(self.sources) == 1 else " (" + ", ".join(
            f"{s.name}: {len(s.records)} x {w:.0%}" for s, w in zip(self.sources,
                                                                    self.batches.weights)) + ")"
        budget = f"--epochs {config.epochs:g}" if config.epochs else "--max-steps"  # which ruled
        text = (f"bigbatch train: {len(self.records)} records{mix}, {len(self.batches)} "
                f"steps/epoch, "
                f"{self.max_steps} steps ({budget}), global batch {self.batches.global_batch} "
                f"({self.info.world_size} process(es) x {config.batch_size}), {sizes}, "
                f"k={'/'.join(str(s.batches.k) for s in self.sources)}, "
                f"{'LoRA r=' + str(lora_r) if lora_r else 'full fine-tuning'} "
                f"({n_train:,} trainable parameters), {self.encoder.encoder_type} encoder, "
                f"device {self.device}")
        if self.step_memory is not None:
            text += f", {describe(self.step_memory)}"
        text += ", " + describe_model_memory(run_model_memory(
            self.encoder, self.model_params, self.info.world_size, config.fsdp, config.dtype))
        if config.mode == "query-side-tune":
            corpus = f": {len(self.corpus.ids):,} documents" if self.corpus is not None else ""
            text += (f", query-side-tune ({config.query_side_backward} backward, "
                     f"{config.doc_negatives} negatives{corpus})")
        return text

    # ------------------------------------------------------------------ evaluate and save
    def evaluate(self, step: int, encoder: Any = None, kind: str = "eval"
                 ) -> dict[str, float] | None:
        """The retrieval metrics on ``--eval-data`` (logged and shown by the main rank), the
        same on every rank; None without evaluation data. Under torchrun every rank embeds
        its share of the texts (:mod:`bigbatch.retrieval.distributed_eval`). ``encoder``:
        another model than the trained one (``merged/``), its rows of ``kind``."""
        from ..retrieval.distributed_eval import split_over_ranks
        from ..retrieval.evaluate import evaluate_sets

        config = self.config
        if not self.eval_sets:
            return None
        metrics = evaluate_sets(split_over_ranks(encoder or self.encoder), self.eval_sets,
                                config.eval_split, batch_size=config.eval_batch_size,
                                device=self.device, progress=self.info.is_main)
        if self.info.is_main:
            self.logger.log(step, metrics, kind=kind)
            if self.columns is None:  # a header over the first row; each evaluation a row
                self.columns = eval_columns(metrics, config.best_metric)
                print(format_eval_row(None, metrics, self.columns), flush=True)
            print(format_eval_row(step if kind == "eval" else kind, metrics, self.columns),
                  flush=True)
        return from_main(metrics, self.info)  # every rank takes the same branches after it

    def save(self, path: Path) -> None:
        """Write a checkpoint (every rank's random state; the main rank writes, and under
        --fsdp or --deepspeed every rank its shards or partitions)."""
        states = gather_rng_states(self.info)
        state = dict(self.state)
        if self.queue is not None:  # the queue the next step takes
            state[STATE_KEY] = self.queue.state_dict()
        if run_scheme(self.config):
            save_sharded_checkpoint(path, encoder=self.encoder, loss_fn=self.loss_fn,
                                    optimizer=self.optimizer, scheduler=self.scheduler,
                                    scaler=self.scaler, state=state,
                                    config=self.config, rank_states=states, info=self.info,
                                    engine=self.engine)
            return
        if self.info.is_main:
            save_checkpoint(path, encoder=self.encoder, loss_fn=self.loss_fn,
                            optimizer=self.optimizer, scheduler=self.scheduler,
                            scaler=self.scaler, state=state, config=self.config,
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
            if self.info.is_main:  # its model card, in best/ and beside the weights
                for folder in (self.out / "best" / "model", self.out / "best"):
                    self._write_card(folder, kind="best", model_dir=self.out / "best" / "model")
        return better

    def _write_card(self, folder: Path, kind: str = "final", model_dir: Path | None = None
                    ) -> Path:
        """The model card ``README.md`` of the weights saved in ``model_dir`` (default
        ``folder``), written into ``folder`` with the run's figures so far."""
        from .card import render_model_card
        from .durable import write_text_safely

        state = {**self.state, "global_batch": self.batches.global_batch}
        text = render_model_card(model_dir or folder, self.config, state,
                                 self.out / "metrics.jsonl", kind=kind,
                                 chunk_sizes=self.cache.chunk_sizes,
                                 repo_id=self.config.push_to_hub if kind == "final" else None)
        write_text_safely(folder / "README.md", text, f"continue with --resume {self.out}")
        return folder / "README.md"

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
        self.step_checks.check(step, values)  # loss and gradient 0, overflowing logits
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
        source = self.source_by_name[batch.source]
        if hasattr(self.loss_fn, "in_batch_negatives"):
            self.loss_fn.in_batch_negatives = source.spec.in_batch_negatives
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        step = self.cache.step
        if self.engine is not None:  # the replays' gradients reduced once, by DeepSpeed
            from ..integrations.deepspeed import deepspeed_step
            step = lambda **inputs: deepspeed_step(self.engine, self.cache, **inputs)  # noqa: E731
        # the first step of an auto-sized run (not again on resume): its peak measured, to
        # check the estimate
        meter = PeakMemory(self.device) if self.chunk_plan is not None \
            and not self.chunks_checked else contextlib.nullcontext()
        # the source's prompts while its inputs are tokenized, or collated and replayed
        with encoder.using_prompts(**source.prompts), meter:
            q = encoder.step_inputs(batch.queries, "query", max_length=config.query_max_length)
            if self.corpus is not None:
                result = step(query=q, **self.corpus.targets(batch, self.device))
            else:
                d = encoder.step_inputs(batch.docs, "doc")
                extra: dict[str, Any] = {}
                if self.guide is not None:  # embedded once, never replayed nor trained
                    extra.update(self.guide.embed(batch.queries, batch.docs))
                if batch.teacher_scores is not None:
                    extra["teacher_scores"] = torch.tensor(batch.teacher_scores,
                                                           dtype=torch.float64,
                                                           device=self.device)
                if self.queue is not None:
                    extra.update(self.queue.arguments(batch))
                result = step(query=q, doc=d, doc_ids=batch.doc_ids, **extra)
                if self.queue is not None:  # this step's documents, for the next steps
                    self.queue.push(result, batch)
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.engine is not None:  # DeepSpeed clips, steps AdamW and the model's schedule
            self.engine.step()
            grad_norm = self.engine.get_global_grad_norm() or 0.0
            clipped = list(self.loss_fn.parameters())  # the temperature, alone
        else:
            clipped = self.all_params
        norm = clip_gradients(clipped, config.max_grad_norm)  # (sharded or not)
        if self.engine is None:
            grad_norm = norm
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
        self.state["sources"][source.name] = [batch.epoch, batch.index + 1]
        if len(self.sources) == 1:  # as checkpoints before mixes kept it
            self.state["epoch"], self.state["index"] = batch.epoch, batch.index + 1
        self.state["examples"] += n
        values = result.to_dict()
        epoch = batch.epoch + (batch.index + 1) / len(source.batches) \
            if len(self.sources) == 1 else self.state["step"] / len(self.batches)
        values.update(lr=lr, grad_norm=float(grad_norm), epoch=epoch,
                      examples_per_s=n / max(time.time() - t0, 1e-9))
        if isinstance(meter, PeakMemory):
            values.update(self._check_first_step(meter.peak))
        if len(self.sources) > 1:  # each source's curves: loss/<name>, accuracy/<name>, ...
            values["source"] = source.name
            for key in _PER_SOURCE:
                if key in values:
                    values[f"{key}/{source.name}"] = values[key]
        return values

    def _check_first_step(self, peak: int | None) -> dict[str, float]:
        """After the first step of an auto-sized run: say how its measured peak compares with
        the estimate and the budget, and lower the chunks once, on every rank as the main
        rank measured, when it went over (a resumed run keeps what its checkpoint says,
        checked or lowered). Returns the values logged with the step."""
        values = {"memory_estimate_mb": self.chunk_plan.memory.total / MiB}
        if peak is not None:
            values["memory_peak_mb"] = peak / MiB
        text, lowered = check_first_step(self.chunk_plan, peak, self.optimizer)
        text, lowered = from_main((text, lowered), self.info)
        if self.info.is_main:
            print(f"bigbatch train: {text}", flush=True)
        self.chunks_checked = True
        if lowered is not None:
            self.chunk_plan = lowered
            self.cache.use_plan(lowered)
        self.state["chunks"] = self._chunk_state()
        return values

    def _push(self) -> dict[str, Any]:
        """Upload ``final/`` (weights and card) to ``--push-to-hub``; a failed upload is
        reported (the run's files are all written) with how to retry, not raised."""
        from .hub import push_folder

        repo, final = self.config.push_to_hub, self.out / "final"
        try:
            url = push_folder(final, repo, f"bigbatch train: {self.out.name}, step "
                                           f"{self.state['step']} (run {self.run_id})")
        except Exception as e:  # noqa: BLE001 - the network, a token, a name taken
            print(f"bigbatch train: could not push {final} to the Hub repository {repo}: "
                  f"{type(e).__name__}: {e}. The model is saved; upload it later with "
                  f"`hf upload {repo} {final}` (after `hf auth login`)", flush=True)
            return {"repo": repo, "error": f"{type(e).__name__}: {e}"}
        print(f"bigbatch train: pushed {final} to {url}", flush=True)
        return {"repo": repo, "url": url}

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

    def preempted(self, received: str) -> RunPreempted:
        """After a step, on every rank, when one was told to stop (``received``: SIGTERM or
        SIGUSR1): the step's checkpoint written (unless ``--save-steps`` just wrote it), and
        the :class:`RunPreempted` saying how to continue."""
        step, config = self.state["step"], self.config
        ckpt = self.out / f"checkpoint-{step:06d}"
        if not (config.save_steps and step % config.save_steps == 0):
            self._save_step(step)
        return RunPreempted(f"bigbatch train: stopped by {received} after step {step} of "
                            f"{self.max_steps}, its checkpoint written ({ckpt.name}); continue "
                            f"with --resume {self.out} (or --resume auto)", step, ckpt, received)

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
        save_whole(self.encoder, out / "final", info, f"continue with --resume {out}",
                   merge_lora=config.merge_lora)  # (a sharded model gathered first)
        line = check_final(self.encoder, self.records, state.get(CHANGE_KEY), out / "final",
                           info, config.eval_batch_size, self.device,
                           f"continue with --resume {out} to write it again", config.dtype)
        if info.is_main:  # final/ reloaded reproduces the trained model, which moved
            print(line, flush=True)
        if state["step"] >= self.max_steps and self.last_eval_step != state["step"]:
            self.last_metrics = self.evaluate(state["step"])
            if self.consider_best(self.last_metrics, state["step"]):  # the final checkpoint
                self.save(out / f"checkpoint-{state['step']:06d}")    # records it
        if config.merge_last:  # the last checkpoints averaged into merged/, evaluated
            self.merged = merge_last(self, config.merge_last)
        if info.is_main:
            self._write_card(out / "final")  # with the final evaluation's figures
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
        if self.merged is not None:  # --merge-last
            summary.update(merged_model=str(out / "merged"), merged=self.merged["metrics"])
        if self.step_checks.seen:  # steps that could not teach (warned about once each)
            summary["futile_steps"] = dict(self.step_checks.seen)
        note = base_beats_best(state["base_metrics"], state["best"], state["best_step"],
                               self.config.best_metric, self.lower_is_better)
        if note:
            summary["base_beats_best"] = True
            if self.info.is_main:
                print(f"bigbatch train: note: {note}", flush=True)
        if self.config.push_to_hub and self.info.is_main:
            summary["push_to_hub"] = self._push()
        if self.info.is_main:  # strict JSON: a metric of no query is null, not NaN
            from ..retrieval.report import json_text
            from .durable import write_text_safely
            write_text_safely(out / "summary.json", json_text(summary, indent=2),
                              f"continue with --resume {out}")
        summary["encoder"] = self.encoder
        return summary
