"""System prompts (ms-swift's system messages) that bigbatch can and cannot apply: bigbatch
gives every query one instruction and every document one, where ms-swift applies each
conversation's own system message."""

from __future__ import annotations

from collections import Counter

from ..records.types import Problem, Record

__all__ = ["SystemCounts", "instruction_problems", "system_prompts", "record_systems"]


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _doc_system(r: Record) -> str | None:
    return r.positive.system


def record_systems(r: Record) -> tuple[str | None, ...]:
    """The system prompts of a record's query and of each of its documents."""
    return (r.query_system, *(d.system for d in (r.positive, *r.negatives)))


# each side's system prompt: (side as messages name it, how a record gives it, its field)
_SIDES = (("query", lambda r: r.query_system, "messages"),
          ("document", _doc_system, "positive_messages[0]"))


class SystemCounts:
    """How often each system prompt occurs per side, and the line of its first record:
    counted one record at a time (:meth:`add`), so a file is checked in one pass with
    bounded memory (:func:`instruction_problems` over a list, or a second pass of
    :meth:`problems` over the records when :meth:`differ`)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {side: Counter() for side, _, _ in _SIDES}
        self.first: dict[str, dict[str, int]] = {side: {} for side, _, _ in _SIDES}

    def add(self, r: Record) -> None:
        for side, get, _ in _SIDES:
            v = get(r)
            if v is not None:
                self.counts[side][v] += 1
                self.first[side].setdefault(v, r.line)

    @staticmethod
    def document_problems(r: Record) -> list[Problem]:
        """The negatives of ``r`` whose system prompt is not the positive's: found from the
        record alone, before the whole file is counted."""
        return [Problem(r.source, r.line, d.key, f"system prompt {_short(d.system)} differs "
                        f"from the positive's {_short(r.positive.system or '')}; bigbatch "
                        f"gives every document one instruction")
                for d in r.negatives if d.system is not None and d.system != r.positive.system]

    def side_problem_count(self) -> int:
        """How many records' prompts differ from their side's usual one (what
        :meth:`problems` reports beside :meth:`document_problems`), from the counts alone."""
        return sum(sum(c.values()) - c.most_common(1)[0][1]
                   for c in self.counts.values() if len(c) > 1)

    def prompts(self) -> dict[str, str]:
        """:func:`system_prompts` of the records counted."""
        out = {}
        for side, c in self.counts.items():
            found = set(c) - {""}
            if len(found) == 1:
                out[side] = found.pop()
        return out

    def differ(self) -> bool:
        """Whether some side has two system prompts (then :meth:`problems` finds them)."""
        return any(len(c) > 1 for c in self.counts.values())

    def problems(self, r: Record) -> list[Problem]:
        """What :func:`instruction_problems` reports on record ``r`` (counted before):
        :meth:`document_problems`, then its prompts that differ from the file's usual ones."""
        out = self.document_problems(r)
        for side, get, field in _SIDES:
            counts = self.counts[side]
            if len(counts) < 2:
                continue
            usual = counts.most_common(1)[0][0]
            v = get(r)
            if v is not None and v != usual:
                out.append(Problem(r.source, r.line, field, (
                    f"{side} system prompt {_short(v)}" if v else f"no {side} system prompt") +
                    f" where the file's usual one is {_short(usual)} (line "
                    f"{self.first[side][usual]}); bigbatch applies one {side} instruction to "
                    f"every record: split the file by instruction (or fold the instruction "
                    f"into the {side} text)"))
        return out


def instruction_problems(records: list[Record]) -> list[Problem]:
    """System prompts (swift) that bigbatch cannot apply as they are: bigbatch gives every
    query one instruction and every document one (``--query-instruction`` /
    ``--doc-instruction``, or ``--query-prefix`` / ``--doc-prefix`` for text models), where
    ms-swift applies each conversation's own system message. So a record's documents must
    carry the same system prompt, and every record the file's usual one for each side; each
    record that does not is a problem naming its line and field (in record order)."""
    counts = SystemCounts()
    for r in records:
        counts.add(r)
    return [p for r in records for p in counts.problems(r)]


def system_prompts(records: list[Record]) -> dict[str, str]:
    """The system prompts the records carry, per side ("query", "document"), when they carry
    one (non-empty) and :func:`instruction_problems` finds none."""
    out = {}
    for side, get, _ in _SIDES:
        found = {get(r) for r in records} - {None, ""}
        if len(found) == 1:
            out[side] = found.pop()
    return out
