"""The corpus-embedding cache: served when nothing changed, recomputed when the corpus, a page
image it names, or the encoder changed."""

from __future__ import annotations

import json
import os

import torch

from bigbatch.retrieval.corpus_cache import embed_corpus


class CountingEncoder:
    """Embeds a document by its text or image bytes; counts how often it is asked to."""

    def __init__(self, name: str = "fake") -> None:
        self.calls = 0
        self.name = name

    def cache_key(self) -> dict:
        return {"model": self.name}

    def encode(self, docs, side, batch_size, device):
        self.calls += 1
        out = []
        for d in docs:
            data = open(d.path, "rb").read() if hasattr(d, "path") else str(d).encode()
            out.append([float(len(data)), float(sum(data) % 997)])
        return torch.tensor(out)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_text_corpus_is_cached_until_it_changes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _write(corpus, [{"_id": "a", "text": "one"}, {"_id": "b", "text": "two"}])
    enc = CountingEncoder()
    ids, first = embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)
    again = embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)[1]
    assert enc.calls == 1 and ids == ["a", "b"] and torch.equal(first, again)
    _write(corpus, [{"_id": "a", "text": "one, edited"}, {"_id": "b", "text": "two"}])
    edited = embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)[1]
    assert enc.calls == 2 and not torch.equal(first, edited)
    other = CountingEncoder("another model")
    embed_corpus(other, corpus, cache_dir=tmp_path / "cache", progress=False)
    assert other.calls == 1


def test_a_page_image_replaced_in_place_is_embedded_again(tmp_path):
    """The corpus file is unchanged; only an image it names is: the cache must not serve the
    old page's vector."""
    (tmp_path / "pages").mkdir()
    page = tmp_path / "pages" / "a.png"
    page.write_bytes(b"old page")
    corpus = tmp_path / "corpus.jsonl"
    _write(corpus, [{"_id": "a", "image": "pages/a.png", "text": ""},
                    {"_id": "b", "text": "a text document"}])
    enc = CountingEncoder()
    old = embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)[1]
    embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)
    assert enc.calls == 1
    stat = page.stat()
    page.write_bytes(b"new page, longer")
    os.utime(page, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new = embed_corpus(enc, corpus, cache_dir=tmp_path / "cache", progress=False)[1]
    assert enc.calls == 2
    assert not torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])


def test_corpus_embeddings_are_written_to_disk_as_made_and_mapped(tmp_path):
    """Blocks go to a file as they are embedded; the matrix comes back mapped from it (not a
    list of blocks and their concatenation), equal to the blocks, and no file is left."""
    corpus = tmp_path / "corpus.jsonl"
    _write(corpus, [{"_id": str(i), "text": "x" * (i + 1)} for i in range(10)])
    work = tmp_path / "work"
    ids, emb = embed_corpus(CountingEncoder(), corpus, cache_dir=work, block=3, progress=False)
    assert emb.untyped_storage().filename is not None  # mapped from the file written
    expected = CountingEncoder().encode(["x" * (i + 1) for i in range(10)], "doc", 1, None)
    assert ids == [str(i) for i in range(10)] and torch.equal(emb, expected)
    assert not [p for p in work.rglob("*.f32")]  # the temporary file is unlinked
    ids2, cached = embed_corpus(CountingEncoder(), corpus, cache_dir=work, progress=False)
    assert torch.equal(cached, expected)  # the cache is read memory-mapped


def test_an_empty_corpus_gives_an_empty_matrix(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("")
    ids, emb = embed_corpus(CountingEncoder(), corpus, progress=False)
    assert ids == [] and emb.shape == (0, 0)
