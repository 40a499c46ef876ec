"""Retrieval: evaluation, the corpus-embedding cache, the token store of multi-vector
models, hard-negative mining and the results report."""
