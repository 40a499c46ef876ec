"""The estimated memory per GPU of each LLM-embedder recipe in configs/ (Qwen3-Embedding
0.6B/4B/8B, Qwen3-VL-Embedding 2B/8B, LoRA and full) on 8 GPUs under ``--fsdp``: an
estimate, from the models' shapes (written below from their config.json files: nothing is
downloaded; the models are built on the meta device, so every parameter is counted without
memory) and the recipes' settings, by the arithmetic ``bigbatch train`` prints in its start
line:

- the model state per GPU (:func:`bigbatch.train.model_memory.model_memory`): weights (in
  the checkpoints' bfloat16, which transformers loads them in), the trainable weights'
  gradients and AdamW's two moments, each split over the 8 GPUs, and the two transformer
  blocks gathered whole at a time (the one computing and the next);
- one GradCache step (:func:`bigbatch.train.memory_estimate.estimate_step_memory`): the
  cached embeddings and their gradients, one loss block, and one chunk's activations, here
  from a formula (bfloat16, a fused attention kernel without the tokens x tokens scores,
  and gradient checkpointing: each block's input kept, one block's activations at a time)
  where the run measures them on a probe chunk.

Not counted: the CUDA context and allocator slack (a few GB), the extra negatives' columns
(``qq``/``dd``) and the vision tower's activations (frozen, run without gradients).

    python bench/llm_memory.py            # the markdown table of docs/guides/distributed.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import yaml

from bigbatch.losses.layout import MAX_BLOCK_LOGITS
from bigbatch.train.memory_estimate import estimate_step_memory
from bigbatch.train.model_memory import lora_parameters, model_memory

GPUS = 8
GPU_GB = 80
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

# the shapes of the models' config.json (text: Qwen3Config; vision-language: Qwen3VLConfig)
TEXT = {
    "Qwen/Qwen3-Embedding-0.6B": dict(vocab_size=151669, hidden_size=1024,
                                      intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128),
    "Qwen/Qwen3-Embedding-4B": dict(vocab_size=151665, hidden_size=2560,
                                    intermediate_size=9728, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "Qwen/Qwen3-Embedding-8B": dict(vocab_size=151665, hidden_size=4096,
                                    intermediate_size=12288, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
VISION_LANGUAGE = {
    "Qwen/Qwen3-VL-Embedding-2B": (
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
             out_hidden_size=2048, patch_size=16, num_position_embeddings=2304,
             deepstack_visual_indexes=[5, 11, 17])),
    "Qwen/Qwen3-VL-Embedding-8B": (
        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
             out_hidden_size=4096, patch_size=16, num_position_embeddings=2304,
             deepstack_visual_indexes=[8, 16, 24])),
}


def meta_model(name: str) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """(the model, its language model, the language model's shapes), on the meta device."""
    from transformers import AutoModel, Qwen3Config, Qwen3VLConfig

    if name in TEXT:
        config = Qwen3Config(**TEXT[name], dtype="bfloat16")
        text = TEXT[name]
    else:
        text, vision = VISION_LANGUAGE[name]
        config = Qwen3VLConfig(text_config={**text, "rope_parameters": {
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
            "mrope_interleaved": True}}, vision_config=vision, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=torch.bfloat16)
    language = getattr(model, "language_model", model)
    return model, language, text


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(model._no_split_modules or ())
    return [m for m in model.modules() if type(m).__name__ in names
            and type(m).__name__.endswith("DecoderLayer")]


def chunk_activations(text: dict, tokens: int, checkpointing: bool, elt: int = 2) -> int:
    """One chunk's activations kept for its backward (see the module docstring): per token
    and block, the norms' and residuals' outputs (4 h), q/k/v before and after their norms
    and rotary (3 (heads + 2 kv) d) and the MLP's gate, up, activation and product (4 i)."""
    h, i, d = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    heads, kv, layers = (text["num_attention_heads"], text["num_key_value_heads"],
                         text["num_hidden_layers"])
    block = tokens * (4 * h + 3 * (heads + 2 * kv) * d + 4 * i) * elt
    if not checkpointing:
        return layers * block
    return layers * tokens * h * elt + block


def estimate(config_file: Path) -> dict:
    recipe = yaml.safe_load(config_file.read_text())
    name = recipe["model"]
    model, language, text = meta_model(name)
    lora = int(recipe.get("lora_r", 0))
    if lora:
        n = lora_parameters(language, lora, LORA_TARGETS)
        trainable = [torch.empty(n, device="meta", dtype=torch.bfloat16)]
    else:  # the vision tower frozen (freeze_vision): the language model trains
        trainable = list(language.parameters())
    state = model_memory(model, trainable, processes=GPUS, sharded=True,
                         blocks=blocks_of(model), compute_bytes=2)
    batch, k = int(recipe["batch_size"]), int(recipe.get("num_hard_negatives", 0))
    chunk, length = int(recipe["grad_cache_chunk"]), int(recipe["max_length"])
    acts = chunk_activations(text, chunk * length, bool(recipe.get("gradient_checkpointing")))
    step = estimate_step_memory({"query": batch, "doc": batch * (1 + k)}, text["hidden_size"],
                                chunk_size=chunk, chunk_activation_bytes=acts,
                                loss_rows=batch, loss_columns=batch * GPUS * (1 + k),
                                max_block_logits=MAX_BLOCK_LOGITS, masked=True)
    params = sum(p.numel() for p in model.parameters())
    return {"recipe": config_file.stem, "params": params,
            "trainable": sum(p.numel() for p in trainable), "state": state, "step": step,
            "batch": batch, "chunk": chunk, "length": length, "k": k,
            "total": state.total + step.total}


def table(rows: list[dict]) -> str:
    gb = 1e9
    out = ["| recipe (`configs/`) | parameters | trained | global batch (k) | chunk x tokens "
           "| weights | gradients | AdamW | gathered blocks | cache + loss block | one chunk "
           "| total per GPU |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, st = r["state"], r["step"]
        cache = st.embeddings + st.embedding_grads + st.rng_states + st.loss_block
        fits = "" if r["total"] <= GPU_GB * gb else " (over 80 GB)"
        out.append(f"| {r['recipe']} | {r['params'] / 1e9:.2f} B | {r['trainable'] / 1e6:,.0f} M "
                   f"| {r['batch'] * GPUS:,} ({r['k']}) | {r['chunk']} x {r['length']} "
                   f"| {s.weights / gb:.2f} GB | {s.gradients / gb:.2f} GB "
                   f"| {s.optimizer_states / gb:.2f} GB | {s.gathered / gb:.2f} GB "
                   f"| {cache / gb:.2f} GB | {st.chunk_activations / gb:.2f} GB "
                   f"| **{r['total'] / gb:.1f} GB**{fits} |")
    return "\n".join(out)


def main() -> None:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = [estimate(p) for p in sorted(CONFIGS.glob("qwen3*.yaml"),
                                        key=lambda p: (p.stem.split("-")[:-1], p.stem))]
    print(table(rows))
    assert all(math.isfinite(r["total"]) for r in rows)


if __name__ == "__main__":
    main()
