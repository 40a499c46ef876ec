"""``bigbatch data fetch scifact --to DIR`` against a local HTTP server on the loopback
address (standing in for BEIR's server), serving a zip built from a small BEIR folder: the
copy lands whole in DIR/scifact and reads as a BEIR directory, and each failure (no network,
an error from the server, a wrong checksum, an archive cut short or damaged or unsafe, a full
disk) is a bigbatch error that leaves nothing behind."""

from __future__ import annotations

import errno
import hashlib
import http.server
import io
import json
import socket
import threading
import zipfile
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data.tools import fetch as fetch_module
from bigbatch.data.tools.fetch import DATASETS, fetch
from bigbatch.errors import BigBatchError, ConfigError, FetchError, OutputError

FILES = {
    "corpus.jsonl": "".join(json.dumps({"_id": f"d{i}", "title": f"title {i}",
                                        "text": f"abstract number {i}"}) + "\n" for i in range(6)),
    "queries.jsonl": "".join(json.dumps({"_id": f"q{i}", "text": f"claim {i}"}) + "\n"
                             for i in range(4)),
    "qrels/train.tsv": "query-id\tcorpus-id\tscore\nq0\td0\t1\nq1\td1\t1\n",
    "qrels/test.tsv": "query-id\tcorpus-id\tscore\nq2\td2\t1\nq3\td3\t1\n",
}


def beir_zip(files=FILES, top="scifact/") -> bytes:
    """A zip of a BEIR folder, laid out as BEIR's scifact.zip is (one top folder)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            zf.writestr(top + name, text)
    return buf.getvalue()


ARCHIVE = beir_zip()
SHA = hashlib.sha256(ARCHIVE).hexdigest()


class Server:
    """An HTTP server on 127.0.0.1 in a thread: ``routes`` maps a path to the bytes it serves
    (or to ``(bytes, content_length)``: a length larger than the body, then the connection
    closes); other paths answer 404. ``hits`` counts the requests."""

    def __init__(self):
        self.routes: dict[str, object] = {}
        self.hits = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.hits += 1
                body = server.routes.get(self.path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                length = len(body) if isinstance(body, bytes) else body[1]
                body = body if isinstance(body, bytes) else body[0]
                self.send_response(200)
                self.send_header("Content-Type", "application/zip")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    s.routes["/scifact.zip"] = ARCHIVE
    yield s
    s.close()


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_fetch_unpacks_a_whole_beir_folder_and_prints_the_licence(server, tmp_path, capsys):
    to = tmp_path / "data"
    assert main(["data", "fetch", "scifact", "--to", str(to), "--url",
                 server.url("/scifact.zip"), "--sha256", SHA]) == 0
    out = capsys.readouterr().out
    for name, text in FILES.items():
        assert (to / "scifact" / name).read_text() == text
    assert leftovers(to) == ["scifact", "scifact/corpus.jsonl", "scifact/qrels",
                             "scifact/qrels/test.tsv", "scifact/qrels/train.tsv",
                             "scifact/queries.jsonl"]  # no temporary file or folder
    assert "CC BY-NC 2.0" in out and "Wadden et al. 2020" in out and str(to / "scifact") in out

    from bigbatch.data import load_beir
    data = load_beir(to / "scifact", "test")
    assert len(data.corpus) == 6 and len(data.queries) == 2

    # a second fetch keeps the copy and downloads nothing
    hits = server.hits
    assert main(["data", "fetch", "scifact", "--to", str(to), "--url",
                 server.url("/scifact.zip"), "--sha256", SHA]) == 0
    assert server.hits == hits and "already holds scifact" in capsys.readouterr().out


def test_an_archive_without_a_top_folder_is_read_too(server, tmp_path):
    server.routes["/flat.zip"] = flat = beir_zip(top="")
    dest = fetch("scifact", tmp_path / "d", url=server.url("/flat.zip"),
                 sha256=hashlib.sha256(flat).hexdigest(), say=lambda _: None)
    assert dest == tmp_path / "d" / "scifact" and (dest / "qrels" / "test.tsv").is_file()


def test_a_file_url_works_like_a_download(tmp_path):
    archive = tmp_path / "scifact.zip"
    archive.write_bytes(ARCHIVE)
    dest = fetch("scifact", tmp_path / "out", url=archive.as_uri(), sha256=SHA, say=lambda _: None)
    assert (dest / "corpus.jsonl").read_text() == FILES["corpus.jsonl"]


def expect_nothing_left(tmp_path: Path, to: Path, error: type, match: str, **kw) -> BigBatchError:
    with pytest.raises(error, match=match) as e:
        fetch("scifact", to, say=lambda _: None, **kw)
    assert isinstance(e.value, BigBatchError)
    assert not to.exists(), leftovers(to)  # the folder this call made is gone as well
    assert leftovers(tmp_path) == [], leftovers(tmp_path)
    return e.value


def test_a_wrong_checksum_unpacks_nothing(server, tmp_path):
    err = expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "SHA-256",
                              url=server.url("/scifact.zip"), sha256="0" * 64)
    assert SHA in str(err) and "--sha256" in str(err)


def test_the_pinned_checksums_are_checked_by_default(server, tmp_path):
    """Without --sha256, a copy served from --url (a mirror) must be BEIR's archive."""
    err = expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "SHA-256",
                              url=server.url("/scifact.zip"))
    assert DATASETS["scifact"].sha256 in str(err)


def test_a_download_cut_short_is_refused(server, tmp_path):
    server.routes["/cut.zip"] = (ARCHIVE[:100], len(ARCHIVE))  # promises more, then closes
    expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "stopped after 100",
                        url=server.url("/cut.zip"), sha256=SHA)


def test_a_truncated_archive_is_refused(server, tmp_path):
    cut = ARCHIVE[: len(ARCHIVE) // 2]  # served whole, with its own checksum: not a zip
    server.routes["/half.zip"] = cut
    expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "not a whole zip archive",
                        url=server.url("/half.zip"), sha256=hashlib.sha256(cut).hexdigest())


def test_an_archive_without_the_data_set_is_refused(server, tmp_path):
    other = beir_zip({"readme.txt": "nothing here"})
    server.routes["/other.zip"] = other
    expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "holds no scifact folder",
                        url=server.url("/other.zip"), sha256=hashlib.sha256(other).hexdigest())


def test_a_member_outside_the_folder_is_refused(server, tmp_path):
    evil = beir_zip({**FILES, "../../evil.txt": "x"})
    server.routes["/evil.zip"] = evil
    expect_nothing_left(tmp_path, tmp_path / "a" / "b", FetchError, "outside its folder",
                        url=server.url("/evil.zip"), sha256=hashlib.sha256(evil).hexdigest())


def test_an_error_from_the_server_is_named(server, tmp_path):
    expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "answered 404",
                        url=server.url("/missing.zip"), sha256=SHA)


def test_no_network_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:  # a port on the loopback address that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = expect_nothing_left(tmp_path, tmp_path / "data", FetchError, "could not download",
                              url=f"http://127.0.0.1:{port}/scifact.zip", sha256=SHA)
    assert "--url file://" in str(err)
    assert main(["data", "fetch", "scifact", "--to", str(tmp_path / "data"), "--url",
                 f"http://127.0.0.1:{port}/scifact.zip"]) == 2
    assert capsys.readouterr().err.startswith("bigbatch: error: data fetch: could not download")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fail_at", [1, 3])  # the download's first block; an unpacked file
def test_a_full_disk_leaves_nothing_behind(server, tmp_path, monkeypatch, fail_at):
    writes = []
    real = fetch_module._write

    class Full:
        def write(self, block):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full(out, block, path):  # the fail_at-th write finds the disk full
        writes.append(path)
        real(Full() if len(writes) == fail_at else out, block, path)

    monkeypatch.setattr(fetch_module, "_write", full)
    err = expect_nothing_left(tmp_path, tmp_path / "data", OutputError, "No space left on device",
                              url=server.url("/scifact.zip"), sha256=SHA)
    assert "is the disk full?" in str(err) and "MB free" in str(err)
    assert len(writes) == fail_at


def test_a_folder_already_there_is_left_as_it_is(server, tmp_path):
    (tmp_path / "data" / "scifact").mkdir(parents=True)
    (tmp_path / "data" / "scifact" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a complete copy"):
        fetch("scifact", tmp_path / "data", url=server.url("/scifact.zip"), sha256=SHA)
    assert leftovers(tmp_path / "data") == ["scifact", "scifact/notes.txt"]
    assert server.hits == 0


@pytest.mark.parametrize("kw, match", [
    ({"sha256": "abc"}, "64 hexadecimal digits"),
    ({"url": "ftp://example.org/scifact.zip"}, "http://, https:// or file://"),
])
def test_bad_options_are_refused_before_any_download(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        fetch("scifact", tmp_path / "data", **kw)
    assert leftovers(tmp_path) == []


def test_the_pinned_archive_is_beirs():
    ds = DATASETS["scifact"]
    assert ds.url == "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets/scifact.zip"
    assert len(ds.sha256) == 64 and len(ds.md5) == 32
    assert set(FILES) == set(ds.files)


def test_tests_without_scifact_skip_with_the_command_that_gets_it(monkeypatch, tmp_path):
    import pipeline_helpers

    monkeypatch.setattr(pipeline_helpers, "SCIFACT", tmp_path / "absent")
    with pytest.raises(pytest.skip.Exception, match="bigbatch data fetch scifact --to data"):
        pipeline_helpers.scifact_slice(tmp_path / "sf")
    assert not (tmp_path / "sf").exists()
