"""Tiny randomly initialised Qwen2-VL / Qwen2.5-VL / Qwen3-VL models with a tokenizer and
image processor built locally, and a tiny Qwen3 text model (the decoder of Qwen3-Embedding):
for tests and for running the vision-language and LLM-embedder paths end to end on a CPU
without downloading anything.

    python -m bigbatch.encoders.tiny runs/tiny-qwen3-vl --family qwen3_vl
    python -m bigbatch.encoders.tiny runs/tiny-qwen3 --family qwen3

writes a folder that ``transformers.AutoModel``, ``AutoTokenizer`` and
``AutoImageProcessor`` load like a real checkpoint. The tokenizer is byte-level (256 byte
tokens and the Qwen special tokens), so any text tokenizes without a vocabulary file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["FAMILIES", "TEXT_FAMILIES", "build_tiny_vl", "build_tiny_text",
           "tiny_vl_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TEXT_FAMILIES = ("qwen3",)


def tiny_vl_tokenizer():
    """A byte-level BPE tokenizer (no merges) with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", padding_side="right")


def build_tiny_vl(path: str | Path, family: str = "qwen3_vl", *, hidden: int = 32,
                  layers: int = 2, vision_layers: int = 2, seed: int = 0,
                  dropout: float = 0.0) -> Path:
    """Write a tiny random ``family`` model, tokenizer and image processor to ``path``.

    ``dropout`` sets the language model's attention dropout (to test dropout replay).
    Returns ``path``; an existing model there is kept.
    """
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if (path / "config.json").exists():
        return path
    hf_logging.disable_progress_bar()
    tok = tiny_vl_tokenizer()
    ids = dict(zip(SPECIAL_TOKENS, tok.convert_tokens_to_ids(SPECIAL_TOKENS)))
    heads = 4
    head_dim = hidden // heads
    half = head_dim // 2
    mrope = [half - 2 * (half // 4), half // 4, half // 4]
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                max_position_embeddings=4096, attention_dropout=dropout,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": mrope})
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLModel as Model

        text["head_dim"] = head_dim
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(depth=vision_layers, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_heads=heads, out_hidden_size=hidden, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        patch = 16
    else:
        if family == "qwen2_vl":
            from transformers import Qwen2VLConfig as Config
            from transformers import Qwen2VLModel as Model

            vision = dict(depth=vision_layers, embed_dim=hidden, hidden_size=hidden,
                          num_heads=heads, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                          temporal_patch_size=2)
        else:
            from transformers import Qwen2_5_VLConfig as Config
            from transformers import Qwen2_5_VLModel as Model

            vision = dict(depth=vision_layers, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_heads=heads, out_hidden_size=hidden, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                          fullatt_block_indexes=[vision_layers - 1])
        patch = 14
    config = Config(text_config=text, vision_config=vision, **common)
    model = Model(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch * 2
    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                             min_pixels=4 * factor * factor, max_pixels=1024 * factor * factor,
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
                             ).save_pretrained(path)
    return path


def build_tiny_text(path: str | Path, family: str = "qwen3", *, hidden: int = 32,
                    layers: int = 2, seed: int = 0, dropout: float = 0.0) -> Path:
    """Write a tiny random decoder-only text model of ``family`` (Qwen3: grouped-query
    attention, rotary positions, q/k norms) and its byte-level tokenizer to ``path``: a
    base model's tokenizer, padding on the right and adding no end-of-text token (what
    ``--pooling last`` arranges itself). Returns ``path``; an existing model there is kept.
    """
    import torch

    if family not in TEXT_FAMILIES:
        raise ValueError(f"family must be one of {TEXT_FAMILIES}, got {family!r}")
    from transformers import Qwen3Config, Qwen3Model
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if (path / "config.json").exists():
        return path
    hf_logging.disable_progress_bar()
    tok = tiny_vl_tokenizer()
    ids = dict(zip(SPECIAL_TOKENS, tok.convert_tokens_to_ids(SPECIAL_TOKENS)))
    heads = 4
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=2, head_dim=hidden // heads,
                         max_position_embeddings=512, attention_dropout=dropout,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    path.mkdir(parents=True, exist_ok=True)
    Qwen3Model(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bigbatch.encoders.tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="output folder")
    p.add_argument("--family", choices=FAMILIES + TEXT_FAMILIES, default="qwen3_vl")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    build = build_tiny_text if a.family in TEXT_FAMILIES else build_tiny_vl
    out = build(a.path, a.family, hidden=a.hidden, layers=a.layers, seed=a.seed)
    print(f"tiny {a.family} model written to {out}")


if __name__ == "__main__":
    main()
