"""Readers: the files data names, opened safely; JSONL, tables, shards and BEIR folders."""
