"""The model card ``README.md`` that ``bigbatch train`` writes beside the weights it saves
(``final/``, ``best/``), in the layout sentence-transformers writes for its own models: YAML
metadata (library, base model, tags, pipeline), a description of the saved model (maximum
length, dimensions, pooling, similarity), usage with sentence-transformers, transformers and
(for a LoRA adapter) peft, the evaluation table of the run, the training data, objective and
hyperparameters, the training logs, framework versions and the citation.

Everything the card says is read from the saved folder (``bigbatch_encoder.json``, the
sentence-transformers module files, ``adapter_config.json``), the run's configuration and
state, and its ``metrics.jsonl``: the card shows the run's real figures.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .durable import write_text_atomic

__all__ = ["render_model_card", "write_model_card"]

_GRADCACHE_BIBTEX = """@inproceedings{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    booktitle={Proceedings of the 6th Workshop on Representation Learning for NLP},
    year={2021},
    url={https://arxiv.org/abs/2101.06983}
}"""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _rows(metrics_path: Path, kind: str, up_to: int | None) -> list[dict[str, Any]]:
    """The rows of ``kind`` in ``metrics.jsonl`` with steps up to ``up_to`` (None: all), in
    file order; torn or foreign lines are skipped."""
    out = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("kind") == kind and isinstance(
                    rec.get("step"), int) and (up_to is None or rec["step"] <= up_to):
                out.append(rec)
    return out


def _eval_rows(metrics_path: Path, up_to: int | None) -> list[dict[str, Any]]:
    """The evaluation rows (steps up to ``up_to``), the last of each step, by step."""
    rows = {rec["step"]: rec for rec in _rows(metrics_path, "eval", up_to)}
    return [rows[s] for s in sorted(rows)]


def _last_train_row(metrics_path: Path, up_to: int | None) -> dict[str, Any]:
    rows = _rows(metrics_path, "train", up_to)
    return rows[-1] if rows else {}


def _hub_id(name: str) -> str | None:
    """``name`` when it reads as a Hub repository id (``namespace/name``), not a local path."""
    if not name or Path(name).exists() or name.startswith(("/", ".", "~")):
        return None
    parts = name.split("/")
    return name if len(parts) == 2 and all(parts) else None


def _versions() -> dict[str, str]:
    out = {"Python": platform.python_version()}
    import importlib.metadata as md

    for label, dist in (("bigbatch", "bigbatch"), ("Sentence Transformers", "sentence-transformers"),
                        ("Transformers", "transformers"), ("PyTorch", "torch"),
                        ("PEFT", "peft"), ("DeepSpeed", "deepspeed")):
        try:
            out[label] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return out


def _metric_table(rows: list[dict[str, Any]], columns: list[str], mark_step: int | None) -> str:
    """A markdown table, one row per evaluation (step 0: the base model); ``mark_step``'s row
    bold (the saved model's)."""
    head = "| Step | " + " | ".join(columns) + " |"
    rule = "|:-----|" + "|".join(":------" for _ in columns) + "|"
    lines = [head, rule]
    for r in rows:
        cells = [f"{r[c]:.4f}" if isinstance(r.get(c), (int, float)) else "-" for c in columns]
        step = "0 (base)" if r["step"] == 0 else str(r["step"])
        if r["step"] == mark_step:
            cells, step = [f"**{c}**" for c in cells], f"**{step}**"
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _front_matter(num_records: int, loss_name: str, adapter: bool, base_id: str | None,
                  metrics: list[str]) -> list[str]:
    """The card's YAML metadata, as the Hub reads it: tags, base model, pipeline, metrics."""
    tags = ["sentence-transformers", "sentence-similarity", "feature-extraction",
            "bigbatch", "gradcache", "generated_from_trainer",
            f"dataset_size:{num_records}", f"loss:{loss_name}"]
    if adapter:
        tags.append("peft")
    front = ["---", "tags:", *[f"- {t}" for t in tags]]
    if base_id:
        front.append(f"base_model: {base_id}")
    front += ["pipeline_tag: sentence-similarity", "library_name: sentence-transformers"]
    if metrics:
        front += ["metrics:", *[f"- {k}" for k in metrics]]
    return [*front, "---"]


def _chunks(chunk_sizes: Mapping[str, int]) -> tuple[str, dict[str, int]]:
    """The chunk sizes a run's GradCache used, as the card's text says them ("8", or "8 (4
    for queries)") and as its loss settings list them."""
    query = chunk_sizes["query"]
    doc = chunk_sizes.get("doc", query)  # corpus negatives: no document tower
    if query == doc:
        return str(doc), {"grad_cache_chunk": doc}
    return f"{doc} ({query} for queries)", {"grad_cache_chunk": doc,
                                            "query_grad_cache_chunk": query}


def render_model_card(model_dir: str | Path, config: Any, state: dict[str, Any],
                      metrics_path: str | Path | None = None, *, chunk_sizes: Mapping[str, int],
                      saved_step: int | None = None, kind: str = "final",
                      repo_id: str | None = None) -> str:
    """The model card of the model saved in ``model_dir``.

    Args:
        model_dir: the saved model folder (``final/``, or ``best/model``).
        config: the run's :class:`~bigbatch.train.TrainConfig`.
        state: the run's state (``step``, ``num_records``, ``best``, ``best_step``, ...).
        chunk_sizes: the rows per chunk of each tower, as the run's GradCache used them
            (``GradCache.chunk_sizes``: ``query``, and ``doc`` unless the documents were a
            fixed corpus).
        metrics_path: the run's ``metrics.jsonl`` (its evaluation rows fill the table).
        saved_step: the step of the saved weights (its row is bold); default the run's step.
        kind: ``"final"`` or ``"best"`` (what the folder holds, said in the description).
        repo_id: the Hub repository the card's usage loads from (default: the folder).
    """
    from .config import TrainConfig

    model_dir = Path(model_dir)
    meta = _read_json(model_dir / "bigbatch_encoder.json")
    pooling_cfg = _read_json(model_dir / "1_Pooling" / "config.json")
    st_cfg = _read_json(model_dir / "sentence_bert_config.json")
    adapter = (model_dir / "adapter_config.json").exists()
    step = state.get("step", 0) if saved_step is None else saved_step
    metrics_path = Path(metrics_path) if metrics_path is not None else None
    evals = _eval_rows(metrics_path, None if kind == "final" else step) if metrics_path else []
    last_train = _last_train_row(metrics_path, step) if metrics_path else {}
    base = str(meta.get("base_model") or config.model)
    base_id = _hub_id(base)
    load_from = repo_id or str(model_dir)
    dim = pooling_cfg.get("word_embedding_dimension")
    max_len = st_cfg.get("max_seq_length", config.max_length)
    pooling = meta.get("pooling", config.pooling)
    sources = config.train_sources()  # one or several (a mix: each its name and path)
    data_name = ", ".join(s.name for s in sources)
    data_paths = ", ".join(f"`{s.path}`" for s in sources)
    counts = state.get("num_records", 0)
    num_records = sum(counts) if isinstance(counts, list) else counts  # a mix: per source
    multivector = config.pooling == "multivector"
    loss_name = ("MaxSimInfoNCE" if multivector else
                 "CorpusInfoNCE" if config.doc_negatives == "corpus" else "InfoNCE")
    temperature = last_train.get("temperature", config.temperature)
    global_batch = state.get("global_batch") or config.batch_size
    chunks, chunk_settings = _chunks(chunk_sizes)
    defaults = TrainConfig().to_dict()
    settings = config.to_dict()
    skip = {"model", "train_data", "eval_data", "output_dir", "resume", "data_root", "device"}
    non_default = {k: v for k, v in settings.items() if k not in skip and v != defaults.get(k)}

    front = _front_matter(num_records, loss_name, adapter, base_id,
                          _metric_columns(evals, config) if evals else [])
    title = f"bigbatch {'best' if kind == 'best' else 'fine-tuned'} model: {Path(config.output_dir).name}"
    base_text = f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"`{base}`"
    kind_text = (f"the best checkpoint by `{config.best_metric}` (step {step})" if kind == "best"
                 else f"the final weights (step {step})")
    lines = [
        *front, "", f"# {title}", "",
        f"This is a [sentence-transformers](https://www.SBERT.net) model finetuned from "
        f"{base_text} on `{data_name}` with bigbatch's "
        f"exact gradient caching (GradCache): a global batch of {global_batch} queries, each "
        f"against every document of the batch, computed in chunks of {chunks} with the "
        f"gradient of the whole batch. "
        f"{'It maps texts to ' + str(dim) + '-dimensional dense vectors' if dim else 'It embeds texts'}"
        f" and can be used for semantic search and retrieval. This folder holds {kind_text}.",
        "", "## Model Details", "", "### Model Description",
        "- **Model Type:** Sentence Transformer" + (" (LoRA adapter, peft)" if adapter else ""),
        f"- **Base model:** {base_text}",
        f"- **Maximum Sequence Length:** {max_len} tokens",
    ]
    if dim:
        lines.append(f"- **Output Dimensionality:** {dim} dimensions")
    lines += [f"- **Pooling:** {pooling}",
              "- **Similarity Function:** Cosine Similarity",
              f"- **Training Dataset:** `{data_name}` ({num_records:,} records)"]
    if config.query_prefix or config.doc_prefix:
        lines.append(f"- **Prompts:** query `{config.query_prefix!r}`, document "
                     f"`{config.doc_prefix!r}`")
    lines += ["", *_usage(load_from, adapter, base, pooling, config)]
    if evals:
        columns = _metric_columns(evals, config)
        eval_name = ", ".join(e.name for e in config.eval_sets())
        lines += ["", "## Evaluation", "", "### Metrics", "",
                  "#### Information Retrieval", "",
                  f"* Dataset: `{eval_name}` (split `{config.eval_split}`), full-corpus "
                  f"retrieval", "* Evaluated with <code>bigbatch.retrieval.evaluate.evaluate_beir</code>",
                  "", _metric_table(evals, columns, step),
                  "", "* The bold row denotes the saved model; step 0 is the base model."]
    lines += ["", "## Training Details", "", "### Training Dataset", "",
              f"#### {data_name}", "",
              f"* Dataset: {data_paths}",
              f"* Size: {num_records:,} training samples",
              "* Columns: query, positive" + (f", and {config.num_hard_negatives} hard "
                                              f"negative(s)" if config.num_hard_negatives else ""),
              f"* Loss: <code>bigbatch.{loss_name}</code> with these parameters:",
              "  ```json",
              "  " + json.dumps({"temperature": config.temperature,
                                 "learnable_temperature": not config.fixed_temperature,
                                 "final_temperature": round(float(temperature), 6),
                                 "symmetric": config.symmetric,
                                 "cross_device_negatives": True,
                                 **chunk_settings}, indent=4)
              .replace("\n", "\n  "),
              "  ```", "", "### Training Hyperparameters", "",
              "#### Non-Default Hyperparameters", "",
              *[f"- `{k}`: {v}" for k, v in non_default.items()], "",
              "#### All Hyperparameters", "<details><summary>Click to expand</summary>", "",
              *[f"- `{k}`: {v}" for k, v in settings.items() if k not in skip], "",
              "</details>"]
    if last_train:
        lines += ["", "### Training Logs", "",
                  _log_table(metrics_path, evals, config.best_metric, step),
                  "", f"* The bold row denotes the saved model. Last logged training loss "
                  f"{last_train.get('loss', float('nan')):.4f} (step {last_train.get('step')}), "
                  f"temperature {float(temperature):.4f}."]
    lines += ["", "### Framework Versions",
              *[f"- {k}: {v}" for k, v in _versions().items()],
              "", "## Citation", "", "### BibTeX", "", "#### GradCache", "```bibtex",
              _GRADCACHE_BIBTEX, "```", ""]
    return "\n".join(lines)


def _log_table(metrics_path: Path, evals: list[dict[str, Any]], metric: str,
               mark_step: int) -> str:
    """sentence-transformers' training-log table: epoch, step, the training loss at that step
    and the evaluation metric, one row per evaluation (without any, about 20 of the logged
    steps, the last among them)."""
    losses = {rec["step"]: (rec.get("epoch", float("nan")), rec.get("loss"))
              for rec in _rows(metrics_path, "train", None)}
    steps = [r["step"] for r in evals] or sorted(losses)
    if not evals and len(steps) > 20:  # no evaluations: about 20 logged steps and the last
        steps = sorted({*steps[::-(-len(steps) // 20)], steps[-1]})
    by_step = {r["step"]: r for r in evals}
    lines = [f"| Epoch | Step | Training Loss | {metric} |", "|:-----:|:----:|:-------------:|:------:|"]
    for s in steps:
        if s > mark_step:
            continue
        epoch, loss = losses.get(s, (0.0 if s == 0 else float("nan"), None))
        value = by_step.get(s, {}).get(metric)
        cells = [f"{epoch:.4f}", str(s), "-" if loss is None else f"{loss:.4f}",
                 "-" if value is None else f"{value:.4f}"]
        if s == mark_step:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _metric_columns(evals: list[dict[str, Any]], config: Any) -> list[str]:
    from .logging import eval_columns

    return eval_columns(evals[-1], config.best_metric)


def _usage(load_from: str, adapter: bool, base: str, pooling: str, config: Any) -> list[str]:
    """The usage sections: sentence-transformers, transformers (pooling by hand), peft."""
    q, d = config.query_prefix or "", config.doc_prefix or ""
    out = ["## Usage", "", "### Direct Usage (Sentence Transformers)", "",
           "First install the Sentence Transformers library:", "", "```bash",
           "pip install -U sentence-transformers" + (" peft" if adapter else ""), "```", "",
           "Then you can load this model and run inference.", "```python",
           "from sentence_transformers import SentenceTransformer", "",
           f"model = SentenceTransformer({load_from!r})",
           f"queries = [{q + 'what reduces the risk of heart disease?'!r}]",
           f"documents = [{d + 'Regular exercise lowers blood pressure.'!r}, "
           f"{d + 'The Eiffel Tower is in Paris.'!r}]",
           "q = model.encode(queries)", "d = model.encode(documents)",
           "print(model.similarity(q, d))", "```", "",
           "### Direct Usage (Transformers)", "", "```python", "import torch",
           "import torch.nn.functional as F"]
    if adapter:
        out += ["from peft import AutoPeftModel", "from transformers import AutoTokenizer", "",
                f"model = AutoPeftModel.from_pretrained({load_from!r})  # base + LoRA adapter"]
    else:
        out += ["from transformers import AutoModel, AutoTokenizer", "",
                f"model = AutoModel.from_pretrained({load_from!r})"]
    pool = {"cls": "out.last_hidden_state[:, 0]",
            "last": "out.last_hidden_state[torch.arange(len(texts)), "
                    "batch['attention_mask'].sum(1) - 1]"}.get(
        pooling, "(out.last_hidden_state * batch['attention_mask'][..., None]).sum(1) / "
                 "batch['attention_mask'].sum(1, keepdim=True)")
    out += [f"tokenizer = AutoTokenizer.from_pretrained({load_from!r})",
            f"texts = [{q + 'what reduces the risk of heart disease?'!r}]",
            f"batch = tokenizer(texts, padding=True, truncation=True, "
            f"max_length={config.max_length}, return_tensors='pt')",
            "with torch.no_grad():", "    out = model(**batch)",
            f"emb = F.normalize({pool}, dim=-1)  # {pooling} pooling", "```"]
    if adapter:
        out += ["", "### Usage with PEFT (the LoRA adapter on its base model)", "", "```python",
                "from peft import PeftModel", "from transformers import AutoModel", "",
                f"base = AutoModel.from_pretrained({base!r})",
                f"model = PeftModel.from_pretrained(base, {load_from!r})",
                "model = model.merge_and_unload()  # optional: one plain transformers model",
                "```"]
    return out


def write_model_card(model_dir: str | Path, config: Any, state: dict[str, Any],
                     metrics_path: str | Path | None = None, **options: Any) -> Path:
    """Write :func:`render_model_card` to ``model_dir/README.md`` (atomically); returns
    its path."""
    path = Path(model_dir) / "README.md"
    write_text_atomic(path, render_model_card(model_dir, config, state, metrics_path,
                                              **options))
    return path
