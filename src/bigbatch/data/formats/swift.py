"""The ``swift`` format: ms-swift's embedding JSONL. ``messages`` (system instruction + user
query), ``positive_messages`` / ``negative_messages`` (one conversation per document, the
user turn holding the text, or ``<image>`` and the text that goes with the image) with
``positive_images`` / ``negative_images``, and the ids as ``query_id`` / ``positive_id`` /
``negative_ids``, teacher scores (for distillation) as ``pos_score`` and ``neg_scores``.
Detected for JSONL whose first record has ``messages``.

A query image, several images in a document, text before ``<image>``, images without an
``<image>`` tag, video and audio, and conversations of more than one user turn (assistant
or tool turns) cannot be held (reported, see :attr:`~bigbatch.data.records.types.Record.lost`).
Each conversation's system message is read as its instruction and written back as it was
(records of other formats get the instruction options, :data:`SWIFT_QUERY_INSTRUCTION` and
:data:`SWIFT_DOC_INSTRUCTION` by default).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..records.types import Doc, Problem, Record
from .common import (
    Format,
    WriteOptions,
    add_ids,
    add_scores,
    jsonl_stream,
    read_all,
    with_ids,
    with_scores,
    write_jsonl,
)

__all__ = ["FORMAT", "SWIFT_QUERY_INSTRUCTION", "SWIFT_DOC_INSTRUCTION"]

# Qwen3-VL-Embedding's instructions (train_contrastors.py and convert_data_for_swift.py)
SWIFT_QUERY_INSTRUCTION = "Retrieve images or text relevant to the user's query."
SWIFT_DOC_INSTRUCTION = "Represent the user's input."
_IMAGE_TAG = "<image>"
_MEDIA_TAGS = ("<video>", "<audio>")


def _turn(conv: Any, key: str, where: tuple[str, int], problems: list[Problem],
          lost: list[tuple[str, str]]) -> tuple[str, str] | None:
    """(system prompt, user content) of one swift conversation; the system prompt is "" when
    the conversation has none. A malformed conversation is a problem (and None). What one
    user turn cannot hold (assistant or tool turns, several user turns, several system
    messages, video or audio) is added to ``lost``: bigbatch embeds one user turn, where
    ms-swift would embed the whole conversation through its template."""
    if not isinstance(conv, list):
        problems.append(Problem(where[0], where[1], key, "must be a list of messages"))
        return None
    for i, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            problems.append(Problem(where[0], where[1], f"{key}[{i}]", "a message needs a "
                                    "'role' and a text 'content'"))
            return None
    roles = [m["role"] for m in conv]
    users = [m for m in conv if m["role"] == "user"]
    systems = [m for m in conv if m["role"] == "system"]
    if not users:
        problems.append(Problem(where[0], where[1], key, "needs a user message"))
        return None
    if len(users) > 1 or len(users) + len(systems) < len(conv):
        lost.append((key, f"a multi-turn conversation (roles {', '.join(roles)}; bigbatch "
                          f"embeds one user turn, with an optional system message)"))
    elif len(systems) > 1 or (systems and roles[0] != "system"):
        lost.append((key, "system messages other than one leading the conversation"))
    content = users[0]["content"]
    for tag in _MEDIA_TAGS:
        if tag in content:
            lost.append((key, f"a {tag} tag (bigbatch embeds text and images)"))
    return (systems[0]["content"] if systems else ""), content


def _doc(conv: Any, images: Any, key: str, where: tuple[str, int],
         problems: list[Problem], lost: list[tuple[str, str]]) -> Doc | None:
    """One swift document conversation: text, or an image (``<image>`` leading the user turn,
    one path in ``images``) with the text that follows it, and its system prompt. What a
    :class:`Doc` cannot hold (several images, text before the image, images without an
    ``<image>`` tag, several turns) is added to ``lost`` as (field, what); a malformed
    document is a problem (and None)."""
    turn = _turn(conv, key, where, problems, lost)
    if turn is None:
        return None
    system, content = turn
    images_key = key.replace("messages", "images")
    tags = content.count(_IMAGE_TAG)
    paths = [] if images is None else images if isinstance(images, list) else None
    if paths is None or not all(isinstance(p, str) and p for p in paths):
        problems.append(Problem(where[0], where[1], images_key, "must be a list of image paths"))
        return None
    if tags != len(paths) and tags:
        problems.append(Problem(where[0], where[1], images_key,
                                f"{len(paths)} image path(s) for {tags} <image> tag(s) in "
                                f"{key}; an <image> document needs exactly one image path"))
        return None
    if not tags:
        if paths:
            lost.append((images_key, f"{len(paths)} image(s) without an <image> tag in {key}"))
        if not content.strip():
            problems.append(Problem(where[0], where[1], key, "empty document text"))
            return None
        return Doc(text=content, key=key, system=system)
    if tags > 1:
        lost.append((images_key, f"{tags} images in one document (a document holds one)"))
    elif not content.lstrip().startswith(_IMAGE_TAG):
        lost.append((key, "text before <image> (an image document's text follows its image)"))
    text = content.replace(_IMAGE_TAG, " ").strip()
    return Doc(image=paths[0], text=text or None, key=f"{images_key}[0]", system=system)


# swift media fields bigbatch has no document kind for
_MEDIA_KEYS = tuple(f"{side}{kind}" for side in ("", "positive_", "negative_")
                    for kind in ("videos", "audios"))


def parse(rec: dict, path: Path, n: int, problems: list[Problem]) -> Record | None:
    """The record of one swift line (the object ``rec`` on line ``n`` of ``path``), or
    None, with what is wrong added to ``problems``."""
    w = (str(path), n)
    lost: list[tuple[str, str]] = []
    query = query_system = None
    turn = _turn(rec.get("messages"), "messages", w, problems, lost) \
        if "messages" in rec else None
    if "messages" not in rec:
        problems.append(Problem(str(path), n, "messages", "missing"))
    elif turn is not None and not turn[1].strip():
        problems.append(Problem(str(path), n, "messages", "needs one non-empty user "
                                "message (the query)"))
    elif turn is not None:
        query_system, query = turn
        if _IMAGE_TAG in query or rec.get("images"):
            lost.append(("images" if rec.get("images") else "messages",
                         "an image in the query (queries are text)"))
    for key in _MEDIA_KEYS:
        if rec.get(key):
            lost.append((key, f"{key.rsplit('_', 1)[-1]} (bigbatch embeds text and images)"))
    pos_convs = rec.get("positive_messages")
    pos = None
    pos_imgs = rec.get("positive_images")
    if not isinstance(pos_convs, list) or len(pos_convs) != 1:
        problems.append(Problem(str(path), n, "positive_messages", "must hold exactly one "
                                "conversation"))
    elif pos_imgs is not None and (not isinstance(pos_imgs, list) or len(pos_imgs) != 1):
        problems.append(Problem(str(path), n, "positive_images", "must hold one list of "
                                "image paths, for the one positive conversation"))
    else:
        imgs = (pos_imgs or [[]])[0]
        pos = _doc(pos_convs[0], imgs, "positive_messages[0]", w, problems, lost)
    negs = []
    neg_convs = rec.get("negative_messages") or []
    neg_imgs = rec.get("negative_images") or \
        [[] for _ in (neg_convs if isinstance(neg_convs, list) else ())]
    if not isinstance(neg_convs, list):
        problems.append(Problem(str(path), n, "negative_messages", "must be a list of "
                                "conversations"))
    elif not isinstance(neg_imgs, list) or len(neg_imgs) != len(neg_convs):
        problems.append(Problem(str(path), n, "negative_images", "one list per negative "
                                "conversation"))
    else:
        for i, (c, im) in enumerate(zip(neg_convs, neg_imgs)):
            d = _doc(c, im, f"negative_messages[{i}]", w, problems, lost)
            if d is not None:
                negs.append(d)
    unread = len(neg_convs) - len(negs) if isinstance(neg_convs, list) else 0
    if query is None or pos is None:
        return None
    pos, negs = with_ids(rec, pos, negs)
    written = len(neg_convs) if isinstance(neg_convs, list) else len(negs)
    pos, negs = with_scores(rec.get("pos_score"), rec.get("neg_scores"), "neg_scores",
                            pos, negs, written, w, problems)
    qid = rec.get("query_id")
    return Record(query, pos, negs, None if qid is None else str(qid), n, str(path),
                  lost, query_system, unread_negatives=unread, query_key="messages")


# the records of a swift JSONL file, one at a time or as a list (``split`` is not used)
stream = jsonl_stream(parse)
read = read_all(stream)


def _messages(system: str | None, instruction: str, content: str | None) -> list[dict]:
    """A swift conversation: the record's own system prompt (None: the format had none, so
    ``instruction``; "": none), then the user turn."""
    system = instruction if system is None else system
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]


def _conv(d: Doc, instruction: str) -> tuple[list[dict], list[str]]:
    content = _IMAGE_TAG + (d.text or "") if d.image else d.text
    return _messages(d.system, instruction, content), [d.image] if d.image else []


def cannot_hold(r: Record) -> str | None:
    """Why swift cannot hold ``r``: a text file (swift holds text or images)."""
    if any(d.kind == "file" for d in (r.positive, *r.negatives)):
        return "swift holds text or images; read text files into text first"
    return None


def to_json(r: Record, query_instruction: str, doc_instruction: str) -> dict[str, Any]:
    """One swift line; the instructions go where a record has no system prompt of its own."""
    pm, pi = _conv(r.positive, doc_instruction)
    negs = [_conv(d, doc_instruction) for d in r.negatives]
    rec: dict[str, Any] = {"messages": _messages(r.query_system, query_instruction, r.query),
                           "positive_messages": [pm],
                           "negative_messages": [m for m, _ in negs]}
    if r.positive.image or any(d.image for d in r.negatives):
        rec["positive_images"] = [pi]
        rec["negative_images"] = [i for _, i in negs]
    add_ids(rec, r)
    add_scores(rec, r)
    return rec


def write(records: Iterable[Record], out: Path, options: WriteOptions) -> None:
    """Write ``records`` as swift JSONL."""
    write_jsonl(out, (to_json(r, options.query_instruction, options.doc_instruction)
                      for r in records))


FORMAT = Format("swift", read, detect_keys=lambda keys: "messages" in keys, write=write,
                cannot_hold=cannot_hold, instructions=True, stream=stream, parse=parse)
