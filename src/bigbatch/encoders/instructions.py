"""The default system instructions of vision-language encoders (Qwen3-VL-Embedding's), in a
module without torch so that ``bigbatch train --help`` can show them."""

__all__ = ["QUERY_INSTRUCTION", "DOC_INSTRUCTION"]

# as Qwen3-VL-Embedding's training pipeline (train_contrastors.py, convert_data_for_swift.py)
# gives them
QUERY_INSTRUCTION = "Retrieve images or text relevant to the user's query."
DOC_INSTRUCTION = "Represent the user's input."
