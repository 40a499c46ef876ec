"""Hard negatives refreshed during training (``--refresh-negatives-every N`` or ``epoch``).

Before step 1, and again after every N steps, the document pool is embedded with the
current weights and every training record's ``--num-hard-negatives`` negatives are mined
again by ``bigbatch mine``'s rules (:func:`bigbatch.retrieval.mining.mine_pairs`: the
query's known positives and their copies excluded, likely false negatives dropped); the
following steps train on them. Records need no negatives of their own: a BEIR training
folder, or pairs, is mined at step 0 by the starting model.

- The pool: ``--negatives-corpus`` (a BEIR folder's ``corpus.jsonl``), else the training
  BEIR folder's corpus, else (pairs) every distinct document of the records, written once
  to a temporary corpus file (the user's files are never rewritten).
- Bounded memory: the corpus is streamed and embedded block by block into a memory-mapped
  file (:func:`bigbatch.retrieval.corpus_cache.embed_corpus`, without its cache: the
  weights change), and under torchrun each rank embeds its share
  (:mod:`bigbatch.retrieval.distributed_eval`); the main rank's choice is used by all.
- The records are not rewritten either: :class:`RefreshedRecords` hands the batches each
  record with its current negatives in place of its own.
- Exact resume: the current negatives (as document ids) and the step they were mined at are
  part of the training state a checkpoint keeps (:meth:`NegativeRefresh.state`); a run
  resumed at a step where a refresh is due mines it then, with the same weights.
- A pair left with fewer than ``--num-hard-negatives`` after filtering (``bigbatch mine``
  would not write it) is completed with documents drawn at random from the pool, never one
  of the query's positives or a copy of one (FlagEmbedding's miner does the same); the log
  counts them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .config import TrainConfig

__all__ = ["NegativeRefresh", "RefreshedRecords", "refresh_of", "EPOCH"]

EPOCH = "epoch"  # --refresh-negatives-every epoch: once per pass over the training data

class RefreshedRecords(Sequence):
    """A source's records with their negatives replaced by the latest mined ones: record
    ``i`` as stored, its ``negatives`` the documents of ``ids[i]`` (``docs``: id -> text or
    image); before the first mining, the records as they are."""

    def __init__(self, records: Sequence[Any]) -> None:
        self.base = records
        self.ids: list[list[str]] | None = None
        self.docs: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r = self.base[i]
        if self.ids is None:
            return r
        return dataclasses.replace(r, negatives=[self.docs[d] for d in self.ids[i]],
                                   neg_scores=None)


def _write_pool(records: Sequence[Any], folder: Path) -> Path:
    """Every distinct document of ``records`` (positives, then given negatives; by content)
    written once as a BEIR ``corpus.jsonl`` in ``folder``: a positive under its id, any
    other document under its content key. Returns the file."""
    from ..data.records.types import ImageDoc, doc_key

    seen: set[str] = set()
    path = folder / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        def add(did: str, doc: Any) -> None:
            key = doc_key(doc)
            if key in seen:
                return
            seen.add(key)
            rec = {"_id": did, "text": "", "image": doc.path} if isinstance(doc, ImageDoc) \
                else {"_id": did, "text": doc}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        for i in range(len(records)):
            r = records[i]
            add(r.positive_id, r.positive)
        for i in range(len(records)):
            for doc in records[i].negatives:
                add(doc_key(doc), doc)
    return path


class NegativeRefresh:
    """The refreshes of one run (a single training source): when they are due, the mining,
    what a checkpoint keeps of them and what the log says.

    Attributes:
        every: steps between refreshes.
        pool: the corpus file negatives are mined from.
        records: the :class:`RefreshedRecords` the source's batches read.
        mined_at: the step the current negatives were mined after (None: not yet).
    """

    def __init__(self, config: TrainConfig, source: Any, info: Any) -> None:
        from ..data.formats import detect_format

        self.config, self.info = config, info
        self.options = config.negatives_mining()
        every = config.refresh_negatives_every
        self.every = len(source.batches) if every == EPOCH else int(every)
        base = source.records
        root = Path(source.spec.path)
        self._tmp: Path | None = None
        if config.negatives_corpus:
            self.pool = Path(config.negatives_corpus) / "corpus.jsonl"
        elif root.is_dir() and detect_format(root) == "beir":
            self.pool = root / "corpus.jsonl"
        else:  # pairs: their own documents, in a temporary corpus removed with this object
            self._tmp = Path(tempfile.mkdtemp(prefix="bigbatch-negatives-"))
            weakref.finalize(self, shutil.rmtree, str(self._tmp), True)
            self.pool = _write_pool(base, self._tmp)
        self._pairs(base)
        self.records = RefreshedRecords(base)
        source.batches.records = self.records  # the batches read the refreshed negatives
        self.mined_at: int | None = None
        self._last_end: tuple[float, int] | None = None  # (time, step) of the last refresh

    def _pairs(self, records: Sequence[Any]) -> None:
        """Each record's (query key, positive's id in the pool), the queries and their
        positives (``qrels``) for mining, the pool's ids, and each query's documents that
        may never be its negatives (its positives and every copy of one, by content).

        Raises:
            ConfigError: a record whose positive is no document of the pool, or a pool too
                small to give a query --num-hard-negatives documents besides its positives.
        """
        from ..data.readers.beir_dir import iter_corpus
        from ..data.records.types import doc_key

        keys = {records[i].positive_key for i in range(len(records))}
        wanted = {records[i].positive_id for i in range(len(records))}
        holding: dict[str, list[str]] = {}  # a positive's content key -> the pool ids holding it
        self.pool_ids: list[str] = []
        found: set[str] = set()
        for block in iter_corpus(self.pool):
            for did, doc in block:
                self.pool_ids.append(did)
                if did in wanted:
                    found.add(did)
                key = doc_key(doc)
                if key in keys:
                    holding.setdefault(key, []).append(did)
        self.pairs: list[tuple[str, str]] = []
        self.queries: dict[str, str] = {}
        self.qrels: dict[str, dict[str, int]] = {}
        self.excluded: dict[str, set[str]] = {}  # query key -> never its negatives
        missing = []
        for i in range(len(records)):
            r = records[i]
            pid = r.positive_id if r.positive_id in found else \
                (holding.get(r.positive_key) or [None])[0]
            if pid is None:
                missing.append(r)
                continue
            q = r.query_id or r.query
            self.pairs.append((q, pid))
            self.queries[q] = r.query
            self.qrels.setdefault(q, {})[pid] = 1
            self.excluded.setdefault(q, set()).update({pid, *holding.get(r.positive_key, ())})
        if missing:
            first = missing[0]
            raise ConfigError(f"--refresh-negatives-every: {len(missing)} training record(s) "
                              f"have a positive that is no document of {self.pool} (first: "
                              f"{first.source}, line {first.line}); negatives are mined "
                              f"against the positive's score, so the pool must hold it: give "
                              f"a --negatives-corpus that does")
        most = max(len(e) for e in self.excluded.values())
        if len(set(self.pool_ids)) - most < self.options.num_negatives:
            raise ConfigError(f"--refresh-negatives-every: {self.pool} holds "
                              f"{len(set(self.pool_ids))} documents, too few for "
                              f"--num-hard-negatives={self.options.num_negatives} negatives "
                              f"besides a query's {most} positive(s)")

    # ------------------------------------------------------------------ when
    def due(self, step: int, max_steps: int) -> bool:
        """Whether negatives are to be mined before step ``step + 1``."""
        return step < max_steps and step % self.every == 0 and self.mined_at != step

    # ------------------------------------------------------------------ mining
    def mine(self, encoder: Any, device: Any) -> list[list[str]]:
        """Each record's newly mined negative ids (as many as survived filtering: up to
        --num-hard-negatives), with the current weights: every rank embeds its share; the
        main rank's choice on every rank."""
        from ..retrieval.distributed_eval import split_over_ranks
        from ..retrieval.mining import mine_pairs
        from .main_rank import from_main

        options = dataclasses.replace(self.options, min_negatives=0)  # every pair, short too
        chosen, _ = mine_pairs(split_over_ranks(encoder), self.pool, self.queries, self.qrels,
                               options, device=device, cache_dir=None,
                               progress=self.info.is_main)
        found = {(q, p): negs for q, p, negs, _ in chosen}
        return from_main([list(found.get(pair, [])) for pair in self.pairs], self.info)

    def _fill(self, i: int, negs: list[str], step: int) -> list[str]:
        """``negs`` completed to --num-hard-negatives with documents drawn at random from the
        pool (never a positive of the query or a copy of one, nor a repeat), as FlagEmbedding's
        miner does when too few candidates survive; the draw depends on the run's seed, the
        step and the record alone (the same on every rank and after a resume)."""
        import random

        k = self.options.num_negatives
        if len(negs) >= k:
            return negs
        rng = random.Random(f"{self.config.seed}-refresh-{step}-{i}")
        never = self.excluded[self.pairs[i][0]]
        out = list(negs)
        while len(out) < k:
            d = self.pool_ids[rng.randrange(len(self.pool_ids))]
            if d not in never and d not in out:
                out.append(d)
        return out

    def refresh(self, step: int, encoder: Any, device: Any) -> dict[str, float]:
        """Mine the negatives the steps after ``step`` train on and use them. Returns what
        the log keeps: seconds, negatives changed, pairs left short and the negatives drawn
        at random to fill them, and the mean step time since the last refresh (when there
        was one)."""
        from ..data.readers.beir_dir import corpus_texts

        t0 = time.time()
        mined = self.mine(encoder, device)
        k = self.options.num_negatives
        short = sum(1 for negs in mined if len(negs) < k)
        drawn = sum(k - len(negs) for negs in mined if len(negs) < k)
        new = [self._fill(i, negs, step) for i, negs in enumerate(mined)]
        old = self.records.ids
        changed = sum(len(set(n) - set(o)) for n, o in zip(new, old)) if old is not None \
            else sum(len(n) for n in new)
        self.records.docs = corpus_texts(self.pool, {d for negs in new for d in negs})
        self.records.ids = new
        self.mined_at = step
        end = time.time()
        values = {"refresh_seconds": end - t0, "negatives_changed": float(changed),
                  "negatives": float(sum(len(n) for n in new)), "pairs_short": float(short),
                  "drawn_at_random": float(drawn)}
        if self._last_end is not None and step > self._last_end[1]:
            values["step_seconds"] = (t0 - self._last_end[0]) / (step - self._last_end[1])
        self._last_end = (end, step)
        return values

    def line(self, step: int, values: dict[str, float]) -> str:
        """What the log says of a refresh after ``step``."""
        total = int(values["negatives"])
        changed = int(values["negatives_changed"])
        cost = f"{values['refresh_seconds']:.1f} s"
        if "step_seconds" in values and values["step_seconds"] > 0:
            cost += (f", {values['refresh_seconds'] / values['step_seconds']:.1f} steps' time "
                     f"at {values['step_seconds']:.2f} s a step")
        when = "before step 1" if step == 0 else f"after step {step}"
        text = (f"bigbatch train: hard negatives mined {when} in {cost}: {changed:,} of "
                f"{total:,} negatives changed ({changed / max(total, 1):.0%}), from "
                f"{self.pool}")
        if values["pairs_short"]:
            text += (f"; {int(values['pairs_short']):,} pair(s) had fewer than "
                     f"{self.options.num_negatives} left after filtering, completed with "
                     f"{int(values['drawn_at_random']):,} document(s) drawn at random")
        return text

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the step the negatives were mined after, and each
        record's negatives as ids (a list of distinct ids and an int32 table into it)."""
        if self.records.ids is None:
            return {"mined_at": None}
        names = sorted({d for negs in self.records.ids for d in negs})
        where = {d: i for i, d in enumerate(names)}
        table = torch.tensor([[where[d] for d in negs] for negs in self.records.ids],
                             dtype=torch.int32)
        return {"mined_at": self.mined_at, "ids": names, "table": table}

    def load(self, saved: dict[str, Any] | None, ckpt: Any) -> None:
        """Take the negatives a checkpoint kept (from :meth:`state`).

        Raises:
            ConfigError: the checkpoint has no refreshed negatives, or they do not fit this
                run's records or pool.
        """
        from ..data.readers.beir_dir import corpus_texts

        if not isinstance(saved, dict):
            raise ConfigError(f"--resume: {ckpt} was written by a run without "
                              f"--refresh-negatives-every; resume it with the options it had")
        if saved.get("mined_at") is None:
            return
        names, table = list(saved["ids"]), saved["table"]
        if tuple(table.shape) != (len(self.records), self.options.num_negatives):
            raise ConfigError(f"--resume: {ckpt} holds refreshed negatives for "
                              f"{table.shape[0]} records x {table.shape[1]}, this run has "
                              f"{len(self.records)} x {self.options.num_negatives}")
        ids = [[names[j] for j in row] for row in table.tolist()]
        docs = corpus_texts(self.pool, set(names))
        if len(docs) != len(names):
            raise ConfigError(f"--resume: {len(names) - len(docs)} of the negatives {ckpt} "
                              f"holds are no documents of {self.pool} (the pool changed "
                              f"since); resume with the corpus it was trained with")
        self.records.ids, self.records.docs = ids, docs
        self.mined_at = int(saved["mined_at"])


def refresh_of(config: TrainConfig, sources: Sequence[Any], info: Any) -> NegativeRefresh | None:
    """The run's :class:`NegativeRefresh`, or None without ``--refresh-negatives-every``."""
    if config.refresh_negatives_every is None:
        return None
    return NegativeRefresh(config, sources[0], info)

