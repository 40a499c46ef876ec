"""Checkpoint merging: ``bigbatch merge`` and ``bigbatch train --merge-last K``.

Several saved models of one architecture become one: the uniform average of N models
(``mean``, a "model soup"; the average of a run's last checkpoints), or the spherical
interpolation of two (``slerp``, tensor by tensor, at ``t`` from the first to the second).
Inputs are what a run writes (``checkpoint-N/``, whose model is in ``model/``; ``best/``;
``final/``) or any saved bigbatch model folder.

LoRA runs are merged in adapter space: the adapters' own weights are averaged (every
``lora_A`` and ``lora_B`` on its own, not their products), so the inputs must share the base
model, the rank, alpha and target modules; a run's ``final/`` takes part through its
``final/adapter/``. Full models are merged weight by weight; a LoRA ``final/`` among full
models takes part through its merged weights.

Weights are read with safetensors alone (nothing is unpickled), one tensor of every input at
a time, summed in float64 and stored in each tensor's own dtype. The merged weights are
loaded into an encoder as the first input's folder is loaded (its settings: pooling, prompts,
maximum length) and written by the encoder's own ``save_final``: the output loads as a run's
``final/`` loads (sentence-transformers, transformers, peft for the adapter in
``adapter/``), written atomically; it never replaces, or lies inside, an input.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import BigBatchError, ConfigError
from .checkpoint import atomic_dir, list_checkpoints, write_errors
from .main_rank import barrier

__all__ = ["METHODS", "MERGE_FILE", "MERGED", "MergeInput", "MergeReport", "resolve_input",
           "mean_tensor", "slerp_tensor", "merge_models", "check_output",
           "checkpoints_to_merge", "check_merge_last", "merge_last"]

METHODS = ("mean", "slerp")
MERGE_FILE = "merge.json"  # in the output: how it was made, from what
MERGED = "merged"  # --merge-last's folder in the run's output folder
# slerp: directions this close to parallel (or anti-parallel) are interpolated linearly
# (the sine of the angle would divide by almost 0), as mergekit does
DOT_THRESHOLD = 0.9995
_ADAPTER_FILE = "adapter_model.safetensors"
_ADAPTER_CONFIG = "adapter_config.json"
_META = "bigbatch_encoder.json"
_STAGE = ".merge-stage"  # inside the output's temporary folder, removed before its rename
# settings of a saved encoder that the inputs must share (the output takes the first's)
_SETTINGS = ("encoder", "pooling", "normalize", "query_prefix", "doc_prefix",
             "exclude_prompt_from_pooling", "dim", "doc_tower")
# what must agree between adapters averaged together
_ADAPTER_KEYS = ("r", "lora_alpha", "target_modules", "modules_to_save", "use_rslora",
                 "use_dora")
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class MergeInput:
    """One input as given (``given``) and what it holds: ``folder``, the model folder (a
    checkpoint's ``model/``); ``adapter``, the folder of its peft adapter (the folder itself
    for a LoRA checkpoint, ``final/adapter/`` for a LoRA run's ``final/``; None without one);
    ``full``: whether it holds full weights too (a ``final/`` does); ``meta``: its
    ``bigbatch_encoder.json``."""

    given: Path
    folder: Path
    adapter: Path | None
    full: bool
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def weight_files(self, space: str) -> dict[str, Path]:
        """Its safetensors files in merge ``space`` ("adapter" or "full"), by the name they
        are matched by across inputs (``adapter/`` + the adapter's file names, and the path
        within the model folder of the rest)."""
        files: dict[str, Path] = {}
        if space == "adapter":
            assert self.adapter is not None
            for f in sorted(self.adapter.glob("*.safetensors")):
                files[f"adapter/{f.name}"] = f
        for f in sorted(self.folder.rglob("*.safetensors")):
            rel = f.relative_to(self.folder)
            if self.adapter is not None and (f.parent == self.adapter or
                                             self.adapter in f.parents):
                continue  # the adapter's files: above (adapter space) or not at all
            if space == "adapter" and len(rel.parts) == 1 and rel.name.startswith("model"):
                continue  # a LoRA final/'s merged weights: the adapter stands for them
            files[str(rel)] = f
        return files

    @property
    def base(self) -> str | None:
        """The base model its adapter was trained on (a resolved path where it is one)."""
        cfg = _read_json(self.adapter / _ADAPTER_CONFIG) if self.adapter is not None else {}
        base = self.meta.get("base_model") or cfg.get("base_model_name_or_path")
        if not isinstance(base, str) or not base:
            return None
        return str(Path(base).resolve()) if Path(base).exists() else base


@dataclass
class MergeReport:
    """What :func:`merge_models` did: the output, the method (and ``t`` for slerp), the
    space ("adapter": LoRA adapters averaged; "full": full weights), the inputs and how many
    tensors were merged (``same``: of them, identical in every input)."""

    output: Path
    method: str
    weight: float | None
    space: str
    inputs: list[str]
    tensors: int
    same: int

    def line(self) -> str:
        how = "averaged" if self.method == "mean" else f"spherically interpolated (t={self.weight:g})"
        what = "LoRA adapters" if self.space == "adapter" else "models"
        return (f"{how} {len(self.inputs)} {what} ({self.tensors} tensors, {self.same} "
                f"identical in every input) into {self.output}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e}); the folder is damaged") from e
    return value if isinstance(value, dict) else {}


def resolve_input(path: str | Path) -> MergeInput:
    """What a merge input holds: a checkpoint (``trainer_state.pt`` beside ``model/``) or
    ``best/`` means its ``model/``; a ``final/`` or other saved model folder itself.

    Raises:
        ConfigError: no such folder, no model in it, or weights that are not safetensors.
    """
    given = Path(path)
    if not given.is_dir():
        raise ConfigError(f"bigbatch merge: {given}: no such folder (give checkpoint-N/, "
                          f"best/, final/ or a saved model folder)")
    folder = given / "model" if (given / "model").is_dir() and (
        (given / "trainer_state.pt").exists() or (given / "model" / _META).exists()) else given
    meta = _read_json(folder / _META)
    adapter: Path | None = None
    if isinstance(meta.get("adapter"), str) and (folder / meta["adapter"]).is_dir():
        adapter = folder / meta["adapter"]  # a LoRA run's final/: merged weights and adapter
    elif (folder / _ADAPTER_CONFIG).exists():
        adapter = folder  # a LoRA checkpoint's model/, or a peft adapter folder
    full = adapter != folder and (folder / "config.json").exists()
    if adapter is None and not full:
        raise ConfigError(f"bigbatch merge: {given} holds no model (no config.json or "
                          f"{_ADAPTER_CONFIG} in {folder})")
    inp = MergeInput(given, folder, adapter, full, meta)
    for space in ("adapter",) if adapter == folder else ("full",) if adapter is None else ():
        if not inp.weight_files(space):
            pickled = sorted(f.name for f in folder.iterdir() if f.suffix in _PICKLED)
            why = (f"only {', '.join(pickled)}, which bigbatch never unpickles" if pickled
                   else "none")
            raise ConfigError(f"bigbatch merge: {folder} holds no safetensors weights "
                              f"({why}); load it and save it with safetensors "
                              f"(save_pretrained(..., safe_serialization=True)) first")
    return inp


def _space(inputs: Sequence[MergeInput]) -> str:
    """Adapter space when every input has an adapter, else full weights when every input
    has them."""
    if all(i.adapter is not None for i in inputs):
        return "adapter"
    if all(i.full for i in inputs):
        return "full"
    adapters = [str(i.given) for i in inputs if not i.full]
    fulls = [str(i.given) for i in inputs if i.adapter is None]
    raise ConfigError(f"bigbatch merge: {adapters[0]} holds a LoRA adapter alone and "
                      f"{fulls[0]} a fully fine-tuned model: they cannot be averaged (an "
                      f"adapter has no full weights); merge the run's final/ (which holds "
                      f"its merged weights) instead of its checkpoint")


def _check_compatible(inputs: Sequence[MergeInput], space: str) -> None:
    """The inputs embed alike (their saved settings) and, in adapter space, have adapters
    of one base model, rank, alpha and targets.

    Raises:
        ConfigError: naming the two files that differ and how.
    """
    first = inputs[0]
    for other in inputs[1:]:
        for key in _SETTINGS:
            a, b = first.meta.get(key), other.meta.get(key)
            if a is not None and b is not None and a != b:
                raise ConfigError(
                    f"bigbatch merge: {other.folder / _META} has {key} {b!r} and "
                    f"{first.folder / _META} {a!r}: the models embed differently and cannot "
                    f"be merged into one")
        if space != "adapter":
            continue
        assert first.adapter is not None and other.adapter is not None
        if first.base != other.base:
            raise ConfigError(
                f"bigbatch merge: the adapter in {other.adapter} was trained on "
                f"{other.base!r} and the one in {first.adapter} on {first.base!r}: adapters "
                f"are merged only over the same base model")
        ca = _read_json(first.adapter / _ADAPTER_CONFIG)
        cb = _read_json(other.adapter / _ADAPTER_CONFIG)
        for key in _ADAPTER_KEYS:
            a, b = ca.get(key), cb.get(key)
            if isinstance(a, list) and isinstance(b, list):
                a, b = sorted(map(str, a)), sorted(map(str, b))
            if a != b:
                raise ConfigError(
                    f"bigbatch merge: {other.adapter / _ADAPTER_CONFIG} has {key} {b!r} and "
                    f"{first.adapter / _ADAPTER_CONFIG} {a!r}: adapters are merged only "
                    f"when their rank, alpha and target modules agree")


def check_output(output: Path, inputs: Sequence[MergeInput], replace: bool = False) -> None:
    """Refuse an output that is an input, lies inside one, or holds one (its atomic write
    would replace it); or, unless ``replace``, a folder that is not empty.

    Raises:
        ConfigError: naming the output and the input.
    """
    out = output.resolve()
    for inp in inputs:
        for src in dict.fromkeys((inp.given, inp.folder)):
            s = src.resolve()
            if out == s or s in out.parents or out in s.parents:
                where = "is" if out == s else "lies inside" if s in out.parents else "holds"
                raise ConfigError(f"bigbatch merge: --output {output} {where} the input "
                                  f"{inp.given}: writing it would replace what is read; "
                                  f"give a folder outside the inputs")
    if not replace and output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"bigbatch merge: --output {output} exists and is not empty; give a "
                          f"new folder (nothing there is replaced)")


def mean_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elementwise mean of ``tensors``, summed in float64, in the first one's dtype
    (integer tensors, such as position ids, must be identical: the first is returned)."""
    first = tensors[0]
    if not first.is_floating_point():
        return first
    total = first.to(torch.float64)
    for t in tensors[1:]:
        total = total + t.to(torch.float64)
    return (total / len(tensors)).to(first.dtype)


def slerp_tensor(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation from ``a`` (``t`` = 0) to ``b`` (``t`` = 1) of two tensors as
    vectors: along the arc between their directions, ``sin((1-t)w)/sin(w) a + sin(tw)/sin(w)
    b`` with ``w`` the angle between them (in float64, in ``a``'s dtype); linear where they
    are (anti-)parallel or one is zero. The endpoints are the inputs exactly."""
    if not a.is_floating_point():
        return a
    x, y = a.to(torch.float64), b.to(torch.float64)
    nx, ny = float(x.norm()), float(y.norm())
    dot = float((x.flatten() @ y.flatten()) / (nx * ny)) if nx > 0 and ny > 0 else 1.0
    if abs(dot) > DOT_THRESHOLD:
        out = (1 - t) * x + t * y
    else:
        w = math.acos(max(-1.0, min(1.0, dot)))
        s = math.sin(w)
        out = (math.sin((1 - t) * w) / s) * x + (math.sin(t * w) / s) * y
    return out.to(a.dtype)


def _merge_file(name: str, files: Sequence[Path], method: str, t: float | None
                ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None, int]:
    """One weight file's merged tensors (read with safetensors, a tensor of every input at a
    time), the first file's metadata and how many tensors were identical everywhere.

    Raises:
        ConfigError: the files hold other tensor names or shapes (another architecture), or
            integer tensors that differ.
    """
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        keys = list(handles[0].keys())
        common = set(keys).intersection(*(h.keys() for h in handles[1:]))
        for f, h in zip(files[1:], handles[1:]):
            # integer buffers one save keeps and another leaves out (BERT's position_ids in
            # older transformers' files) are no weights: the first input's are kept
            odd = [k for k in sorted(set(h.keys()) ^ set(keys))
                   if _is_float(handles[0] if k in keys else h, k)]
            if odd:
                raise ConfigError(f"bigbatch merge: {f} and {files[0]} hold different "
                                  f"weights ({', '.join(odd[:3])} in one only): models of "
                                  f"another architecture or LoRA setting cannot be merged")
        merged, same = {}, 0
        for key in (k for k in keys if k not in common):
            merged[key] = handles[0].get_tensor(key)
        for key in (k for k in keys if k in common):
            parts = [h.get_tensor(key) for h in handles]
            for f, p in zip(files[1:], parts[1:]):
                if p.shape != parts[0].shape:
                    raise ConfigError(f"bigbatch merge: {key} is {tuple(p.shape)} in {f} and "
                                      f"{tuple(parts[0].shape)} in {files[0]}: models of "
                                      f"another shape cannot be merged")
                if not parts[0].is_floating_point() and not torch.equal(p, parts[0]):
                    raise ConfigError(f"bigbatch merge: {key} (integers) differs between "
                                      f"{f} and {files[0]}; it cannot be averaged")
            same += all(torch.equal(p, parts[0]) for p in parts[1:])
            merged[key] = mean_tensor(parts) if method == "mean" else \
                slerp_tensor(parts[0], parts[1], float(t))
        return merged, handles[0].metadata(), same


def _is_float(handle: Any, key: str) -> bool:
    """Whether tensor ``key`` of an open safetensors file is a floating-point one (a weight),
    read from its header."""
    return str(handle.get_slice(key).get_dtype()).upper().startswith(("F", "BF"))


def _stage(template: MergeInput, space: str, stage: Path) -> Path:
    """A model folder laid out as ``template``'s, without its weights (they are written
    there merged): the folder's other files, and in adapter space its adapter's
    (``adapter/``, named by the stage's ``bigbatch_encoder.json``)."""
    skip = {template.adapter} if template.adapter not in (None, template.folder) else set()

    def copy_files(src: Path, dest: Path, leave: set[str]) -> None:
        for f in sorted(src.rglob("*")):
            if not f.is_file() or f.suffix == ".safetensors" or f.name in leave or any(
                    s in f.parents for s in skip) or (src / _STAGE) in f.parents:
                continue
            target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)

    stage.mkdir(parents=True)
    in_root = {_ADAPTER_CONFIG, "README.md"} if template.adapter == template.folder else {"README.md"}
    copy_files(template.folder, stage, in_root)
    meta = dict(template.meta)
    meta.pop("adapter", None)
    if space == "adapter":
        assert template.adapter is not None
        skip.discard(template.adapter)
        (stage / "adapter").mkdir(exist_ok=True)
        shutil.copyfile(template.adapter / _ADAPTER_CONFIG, stage / "adapter" / _ADAPTER_CONFIG)
        meta.update(adapter="adapter", lora=False)
        if template.base:
            meta["base_model"] = template.base
    (stage / _META).write_text(json.dumps(meta, indent=2))
    return stage


def merge_models(paths: Sequence[str | Path], output: str | Path, method: str = "mean",
                 weight: float | None = None, replace: bool = False) -> MergeReport:
    """Merge the models in ``paths`` into ``output`` (see the module's description):
    ``mean`` of two or more, or ``slerp`` of two at ``weight`` (t, default 0.5).
    ``replace``: an existing ``output`` is replaced (a run's own ``merged/``).

    Raises:
        ConfigError: fewer than two inputs, one given twice, an unknown method, a weight
            without slerp or outside [0, 1], inputs that cannot be merged (another base,
            rank or shape: naming the files), or an output that would replace an input.
        OutputError: the output could not be written (a full disk).
    """
    from ..encoders.loading import load_encoder

    if method not in METHODS:
        raise ConfigError(f"bigbatch merge: --method must be one of {METHODS}, got {method!r}")
    if len(paths) < 2:
        raise ConfigError(f"bigbatch merge: give at least two models to merge (got "
                          f"{len(paths)})")
    seen = [Path(p).resolve() for p in paths]
    if len(set(seen)) != len(seen):
        twice = next(p for p in paths if seen.count(Path(p).resolve()) > 1)
        raise ConfigError(f"bigbatch merge: {twice} is given twice")
    if method == "slerp":
        if len(paths) != 2:
            raise ConfigError(f"bigbatch merge: --method slerp interpolates two models, got "
                              f"{len(paths)}")
        weight = 0.5 if weight is None else float(weight)
        if not 0 <= weight <= 1:
            raise ConfigError(f"bigbatch merge: --weight must be in [0, 1] (0: the first "
                              f"model, 1: the second), got {weight}")
    elif weight is not None:
        raise ConfigError("bigbatch merge: --weight is the t of --method slerp; mean averages "
                          "its models uniformly")
    inputs = [resolve_input(p) for p in paths]
    output = Path(output)
    check_output(output, inputs, replace=replace)
    space = _space(inputs)
    _check_compatible(inputs, space)
    files = [i.weight_files(space) for i in inputs]
    for inp, own in zip(inputs[1:], files[1:]):
        if set(own) != set(files[0]):
            odd = sorted(set(own) ^ set(files[0]))
            raise ConfigError(f"bigbatch merge: {inp.folder} and {inputs[0].folder} hold "
                              f"different weight files ({', '.join(odd[:3])}): models of "
                              f"another architecture cannot be merged")
    from safetensors.torch import save_file

    hint = "nothing was replaced; free some space and run the merge again"
    tensors = same = 0
    with atomic_dir(output) as tmp, write_errors(output, hint):
        stage = _stage(inputs[0], space, tmp / _STAGE)
        for name in files[0]:
            merged, metadata, n_same = _merge_file(name, [f[name] for f in files], method,
                                                   weight)
            tensors, same = tensors + len(merged), same + n_same
            target = stage / name
            target.parent.mkdir(parents=True, exist_ok=True)
            save_file(merged, str(target), metadata=metadata)
            del merged
        encoder = load_encoder(stage, with_adapter=space == "adapter")
        # the names the merged folder records: its base model, not the staging folder
        base = inputs[0].base if space == "adapter" else \
            inputs[0].meta.get("base_model") or str(inputs[0].given.resolve())
        encoder.base_model_name = base or encoder.base_model_name
        encoder.model_name = str(output)
        shutil.rmtree(stage)
        encoder.save_final(tmp, keep_adapter=True)
        report = MergeReport(output, method, weight, space, [str(i.given) for i in inputs],
                             tensors, same)
        (tmp / MERGE_FILE).write_text(json.dumps(
            {"method": method, "weight": weight, "space": space,
             "inputs": [str(i.given.resolve()) for i in inputs]}, indent=2) + "\n")
    return report


def checkpoints_to_merge(output_dir: str | Path, k: int, run_id: str | None) -> list[Path]:
    """The run's last ``k`` checkpoints (``--merge-last``), oldest first.

    Raises:
        ConfigError: fewer than ``k`` are there.
    """
    found = [p for _, p in list_checkpoints(output_dir, run_id)][-k:]
    if len(found) < k:
        raise ConfigError(f"--merge-last {k}: {output_dir} holds {len(found)} checkpoint(s) of "
                          f"this run; lower --merge-last or save more often (--save-steps)")
    return found


def check_merge_last(k: int, save_steps: int, save_total_limit: int, max_steps: int) -> None:
    """Refuse a ``--merge-last k`` the run cannot satisfy, before step 1: no checkpoints
    during the run, fewer kept than ``k``, or fewer written in ``max_steps`` steps.

    Raises:
        ConfigError: naming the option and what to change.
    """
    if not k:
        return
    if k < 2:
        raise ConfigError(f"--merge-last: must be >= 2 (the checkpoints averaged; 0: off), "
                          f"got {k}")
    if not save_steps:
        raise ConfigError(f"--merge-last {k} averages the run's last checkpoints: give "
                          f"--save-steps N so that the run writes them")
    if save_total_limit < k:
        raise ConfigError(f"--merge-last {k}: --save-total-limit {save_total_limit} keeps "
                          f"fewer checkpoints than are averaged; give --save-total-limit "
                          f">= {k}")
    if max_steps:
        written = len({s for s in range(save_steps, max_steps, save_steps)} | {max_steps})
        if written < k:
            raise ConfigError(f"--merge-last {k}: the run writes {written} checkpoint(s) in "
                              f"its {max_steps} steps (--save-steps {save_steps}); lower "
                              f"--merge-last or --save-steps")


def merge_last(trainer: Any, k: int) -> dict[str, Any]:
    """``--merge-last k`` at the end of a run; every rank calls it. The main rank averages
    the run's last ``k`` checkpoints into ``<output-dir>/merged/`` (replacing the one an
    interrupted end of this run wrote) while the others wait (a failure is raised on every
    rank); then, with evaluation data, every rank evaluates it as the run evaluates
    (``trainer.evaluate``: a ``merged`` row in ``metrics.jsonl``). ``trainer``: the run's
    :class:`~bigbatch.train.loop.Trainer`. Returns ``{"path", "inputs", "metrics"}``."""
    from ..encoders.loading import load_encoder
    from ..engine import distributed as D

    info, out = trainer.info, trainer.out
    path, error, inputs = out / MERGED, None, []
    if info.is_main:
        try:
            found = checkpoints_to_merge(out, k, trainer.run_id)
            inputs = [p.name for p in found]
            report = merge_models(found, path, replace=True)
            print(f"bigbatch train: --merge-last {k}: {report.line()} (from "
                  f"{', '.join(inputs)})", flush=True)
        except BigBatchError as e:
            error = e
    if info.world_size > 1:
        barrier(info)
        D.raise_together(error)
    elif error is not None:
        raise error
    metrics = None
    if trainer.eval_sets:
        encoder = load_encoder(path).to(trainer.device)
        metrics = trainer.evaluate(trainer.state["step"], encoder=encoder, kind=MERGED)
        del encoder
    return {"path": str(path), "inputs": inputs, "metrics": metrics}
