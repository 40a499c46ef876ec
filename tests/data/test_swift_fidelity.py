"""ms-swift records as ms-swift reads them: each conversation's system message is its
instruction (kept through convert, applied in training or refused when bigbatch cannot apply
it), and what one user turn cannot hold (assistant or tool turns, video, audio, a second
positive image list) is reported, never dropped silently."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigbatch.cli import main
from bigbatch.data.formats import read_records, write_records
from bigbatch.data.records.loader import TrainRecord, load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import ConfigError, DataError


def conv(content: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": content}]


def rec(q="q", p="p", negs=("n",), qs=None, ds=None, **extra) -> dict:
    r = {"messages": conv(q, qs), "positive_messages": [conv(p, ds)],
         "negative_messages": [conv(n, ds) for n in negs]}
    r.update(extra)
    return r


def write(path: Path, *recs: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def test_system_prompts_are_read_and_survive_a_swift_round_trip(tmp_path):
    src = write(tmp_path / "s.jsonl", rec("q1", "p1", qs="Find the claim.", ds="Doc."),
                rec("q2", "p2", qs="Find the claim."))  # a document without a system message
    (a, b), problems = read_records(src)
    assert (a.query_system, a.positive.system, a.negatives[0].system) == \
        ("Find the claim.", "Doc.", "Doc.")
    assert (b.query_system, b.positive.system) == ("Find the claim.", "")
    out = tmp_path / "back.jsonl"
    write_records([a, b], out, "swift")  # each keeps its own (or no) system message
    back = [json.loads(line) for line in out.read_text().splitlines()]
    assert back[0]["messages"] == conv("q1", "Find the claim.")
    assert back[0]["positive_messages"] == [conv("p1", "Doc.")]
    assert back[1]["positive_messages"] == [conv("p2")]


def test_convert_says_which_records_keep_their_own_system_messages(tmp_path, capsys):
    src = write(tmp_path / "s.jsonl", rec("q1", qs="Find A."), rec("q2"))
    assert main(["convert", "--to", "swift", "--query-instruction", "Other.", str(src),
                 str(tmp_path / "o.jsonl")]) == 0
    assert "note: 2 record(s) keep their own system messages" in capsys.readouterr().out
    back = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [b["messages"] for b in back] == [conv("q1", "Find A."), conv("q2")]


def test_differing_system_prompts_are_reported_not_dropped(tmp_path, capsys):
    src = write(tmp_path / "s.jsonl", rec("q1", qs="Find A."), rec("q2", qs="Find A."),
                rec("q3", qs="Find B."), rec("q4", "p4", ["n4"], ds=None),
                {**rec("q5", qs="Find A."), "negative_messages": [conv("n5", "Other.")]})
    n, problems = validate_file(src)
    found = [(p.line, p.field) for p in problems]
    assert (3, "messages") in found and (5, "negative_messages[0]") in found
    assert any("query system prompt 'Find B.'" in p.message for p in problems)
    with pytest.raises(DataError, match="s.jsonl:3, field 'messages'"):
        load_records(src)
    # a format without an instruction field cannot hold them: stop, or drop and count
    assert main(["convert", "--to", "st", str(src), str(tmp_path / "o.jsonl")]) == 2
    assert "carry system prompts that differ" in capsys.readouterr().err
    report = write_records(read_records(src)[0], tmp_path / "o.jsonl", "st", allow_lossy=True)
    assert report["system_prompts_dropped"] == 4 and report["written"] == 5


def test_one_system_prompt_per_side_is_named_when_the_target_cannot_hold_it(tmp_path, capsys):
    src = write(tmp_path / "s.jsonl", rec("q1", qs="Find A.", ds="Doc."),
                rec("q2", "p2", qs="Find A.", ds="Doc."))
    assert main(["convert", "--to", "st", str(src), str(tmp_path / "o.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "query system prompt 'Find A.' is not written" in out
    assert "--query-instruction 'Find A.'" in out and "--doc-prefix 'Doc. '" in out


def test_training_applies_the_data_system_prompt_or_refuses(tmp_path):
    from bigbatch.data.records.loader import check_instructions

    src = write(tmp_path / "s.jsonl", rec("q1", qs="Find A.", ds="Doc."),
                rec("q2", "p2", qs="Find A.", ds="Doc."))
    records = load_records(src)
    assert {(r.query_system, r.doc_system) for r in records} == {("Find A.", "Doc.")}
    vision = SimpleNamespace(query_instruction="Retrieve images or text relevant to the "
                             "user's query.", doc_instruction="Doc.")
    with pytest.raises(ConfigError, match=r"s.jsonl:1: .*query system prompt is 'Find A.'.*"
                       r"--query-instruction 'Find A.'"):
        check_instructions(records, vision)
    check_instructions(records, SimpleNamespace(query_instruction="Find A.",
                                                doc_instruction="Doc."))
    with pytest.raises(ConfigError, match=r"--query-prefix 'Find A. '"):
        check_instructions(records, SimpleNamespace(query_prefix="", doc_prefix="Doc. "))
    check_instructions(records, SimpleNamespace(query_prefix="Find A. ", doc_prefix="Doc. "))
    # records without system messages leave the encoder's settings alone
    plain = [TrainRecord("q", "p", query_system="", doc_system="")]
    check_instructions(plain, SimpleNamespace(query_prefix="query: ", doc_prefix=""))


@pytest.mark.parametrize("record,field,what", [
    (rec(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
     "messages", "a multi-turn conversation (roles user, assistant"),
    (rec(messages=[{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}]),
     "messages", "a multi-turn conversation (roles user, tool"),
    (rec(p="<video>a clip", positive_videos=[["v.mp4"]]), "positive_videos", "videos"),
    (rec(p="<audio>a sound"), "positive_messages[0]", "a <audio> tag"),
    (rec(negative_messages=[[{"role": "user", "content": "n1"}, {"role": "user",
                                                                   "content": "n2"}]]),
     "negative_messages[0]", "a multi-turn conversation (roles user, user"),
])
def test_what_one_user_turn_cannot_hold_is_reported(tmp_path, record, field, what):
    src = write(tmp_path / "s.jsonl", record, rec("another query"))
    n, problems = validate_file(src)
    assert n == 2 and (1, field) in [(p.line, p.field) for p in problems]
    assert any(p.message.startswith(what) for p in problems)
    with pytest.raises(DataError, match="s.jsonl:1"):
        load_records(src)
    with pytest.raises(DataError, match="cannot be written as contrastors without loss"):
        write_records(read_records(src)[0], tmp_path / "o.jsonl", "contrastors")


def test_a_second_positive_image_list_is_a_problem(tmp_path):
    src = write(tmp_path / "s.jsonl", rec(positive_images=[[], ["x.png"]]))
    records, problems = read_records(src)
    assert records == [] and [(p.line, p.field) for p in problems] == [(1, "positive_images")]


def test_image_paths_as_ms_swift_writes_them(tmp_path, monkeypatch):
    """'~' is the home folder (ms-swift expands it); a path that ms-swift would find relative
    to the working directory, or a URL, is named as such in the report."""
    from PIL import Image

    home = tmp_path / "home"
    (home / "pages").mkdir(parents=True)
    Image.new("RGB", (2, 2)).save(home / "pages" / "p.png")
    monkeypatch.setenv("HOME", str(home))
    data = tmp_path / "data"
    data.mkdir()
    img = {"messages": conv("q"), "positive_messages": [conv("<image>")]}
    src = write(data / "s.jsonl", {**img, "positive_images": [["~/pages/p.png"]]},
                {**img, "positive_images": [["pages/p.png"]]},
                {**img, "positive_images": [["https://example.com/p.png"]]})
    monkeypatch.chdir(home)
    _, problems = validate_file(src)
    assert [(p.line, p.field) for p in problems] == \
        [(2, "positive_images[0][0]"), (3, "positive_images[0][0]")]
    assert "exists relative to the working directory" in problems[0].message
    assert "local image files only" in problems[1].message
    write_records(read_records(src)[0][:1], tmp_path / "out" / "o.jsonl", "swift")
    out = json.loads((tmp_path / "out" / "o.jsonl").read_text())
    assert out["positive_images"] == [["~/pages/p.png"]]  # not rebased as a relative path
