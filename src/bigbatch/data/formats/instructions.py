"""System prompts (ms-swift's system messages) that bigbatch can and cannot apply: bigbatch
gives every query one instruction and every document one, where ms-swift applies each
conversation's own system message."""

from __future__ import annotations

from collections import Counter

from ..types import Problem, Record

__all__ = ["instruction_problems", "system_prompts", "record_systems"]


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _doc_system(r: Record) -> str | None:
    return r.positive.system


def record_systems(r: Record) -> tuple[str | None, ...]:
    """The system prompts of a record's query and of each of its documents."""
    return (r.query_system, *(d.system for d in (r.positive, *r.negatives)))


def instruction_problems(records: list[Record]) -> list[Problem]:
    """System prompts (swift) that bigbatch cannot apply as they are: bigbatch gives every
    query one instruction and every document one (``--query-instruction`` /
    ``--doc-instruction``, or ``--query-prefix`` / ``--doc-prefix`` for text models), where
    ms-swift applies each conversation's own system message. So a record's documents must
    carry the same system prompt, and every record the file's usual one for each side; each
    record that does not is a problem naming its line and field."""
    problems = []
    for r in records:
        for d in r.negatives:
            if d.system is not None and d.system != r.positive.system:
                problems.append(Problem(r.source, r.line, d.key, f"system prompt "
                                        f"{_short(d.system)} differs from the positive's "
                                        f"{_short(r.positive.system or '')}; bigbatch gives "
                                        f"every document one instruction"))
    for side, get, field in (("query", lambda r: r.query_system, "messages"),
                             ("document", _doc_system, "positive_messages[0]")):
        counts = Counter(get(r) for r in records if get(r) is not None)
        if len(counts) < 2:
            continue
        usual = counts.most_common(1)[0][0]
        first = next(r.line for r in records if get(r) == usual)
        for r in records:
            v = get(r)
            if v is not None and v != usual:
                problems.append(Problem(r.source, r.line, field, (
                    f"{side} system prompt {_short(v)}" if v else f"no {side} system prompt") +
                    f" where the file's usual one is {_short(usual)} (line {first}); bigbatch "
                    f"applies one {side} instruction to every record: split the file by "
                    f"instruction (or fold the instruction into the {side} text)"))
    return problems


def system_prompts(records: list[Record]) -> dict[str, str]:
    """The system prompts the records carry, per side ("query", "document"), when they carry
    one (non-empty) and :func:`instruction_problems` finds none."""
    out = {}
    for side, get in (("query", lambda r: r.query_system), ("document", _doc_system)):
        found = {get(r) for r in records} - {None, ""}
        if len(found) == 1:
            out[side] = found.pop()
    return out
