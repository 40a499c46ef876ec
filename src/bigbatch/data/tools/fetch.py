"""``bigbatch data fetch``: a public data set downloaded, checked and unpacked into a folder.

SciFact, the BEIR data set the demos and the tests use, comes from BEIR's public archive.
The download is written to a temporary file beside its destination while its SHA-256 is
computed; a checksum that differs stops it before anything is unpacked. The archive is
unpacked into a temporary folder (every member's name checked: nothing is written outside
it) that is renamed into place once it holds the whole data set, so the destination is
either complete or absent. No network, an address that answers with an error, a wrong
checksum, a truncated or damaged archive, a full disk: each raises a bigbatch error
(:class:`~bigbatch.errors.FetchError`, :class:`~bigbatch.errors.OutputError`) and leaves
nothing behind. Only the standard library is used (urllib, zipfile, hashlib).
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ...errors import ConfigError, FetchError, OutputError

__all__ = ["Dataset", "DATASETS", "fetch", "is_complete"]

BLOCK = 1 << 20  # bytes read and written at a time


@dataclass(frozen=True)
class Dataset:
    """A data set ``bigbatch data fetch`` knows: where its archive is, the checksums it
    must have, what a complete copy holds and the terms it comes under."""

    name: str
    url: str
    sha256: str
    md5: str | None          # the checksum the archive's publisher lists, checked as well
    files: tuple[str, ...]   # paths (POSIX) that a complete copy holds
    licence: str
    cite: str


DATASETS: dict[str, Dataset] = {
    "scifact": Dataset(
        name="scifact",
        url="https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets/scifact.zip",
        # SHA-256 of scifact.zip (2,816,079 bytes) as several public projects that pin BEIR's
        # archive record it; its scifact/corpus.jsonl has the SHA-256 that the copy the tests
        # were written against has (dec31c81...). The MD5 is the one BEIR publishes in the
        # data set table of its README (beir-cellar/beir).
        sha256="536e14446a0ba56ed1398ab1055f39fe852686ecad24a6306c80c490fa8e0165",
        md5="5f7d1de60b170fc8027bb7898e2efca1",
        files=("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"),
        licence="CC BY-NC 2.0, as the BigBio dataset card gives it: non-commercial research "
                "use; keep it out of repositories you publish",
        cite="Wadden et al. 2020, \"Fact or Fiction: Verifying Scientific Claims\" (EMNLP); "
             "BEIR's copy: Thakur et al. 2021, \"BEIR: A Heterogeneous Benchmark for "
             "Zero-shot Evaluation of Information Retrieval Models\" (NeurIPS)",
    ),
}


def is_complete(folder: str | Path, dataset: Dataset) -> bool:
    """Whether ``folder`` holds every file of a copy of ``dataset``."""
    return all((Path(folder) / f).is_file() for f in dataset.files)


def fetch(name: str, to: str | Path, *, url: str | None = None, sha256: str | None = None,
          timeout: float = 60.0, say: Callable[[str], None] = print) -> Path:
    """Download data set ``name`` (a key of :data:`DATASETS`), check it, and unpack it into
    ``to/<name>``; print (through ``say``) what was done and the data set's licence.

    ``url`` replaces the archive's address (a mirror, a local server, ``file://``); ``sha256``
    the checksum it must have (the publisher's MD5 is then not checked: it names the
    pinned archive). A complete copy already in ``to/<name>`` is kept and nothing is
    downloaded.

    Returns:
        the data set's folder, ``to/<name>``.

    Raises:
        ConfigError: an unknown data set, a malformed checksum or address, ``to`` a file, or
            ``to/<name>`` present but not a complete copy (it is left as it is).
        FetchError: no network, an error from the server, a checksum that differs, an
            archive cut short, damaged, unsafe or without the data set's files.
        OutputError: ``to`` could not be written (a full disk, no permission).

    Example::

        fetch("scifact", "data")                      # -> data/scifact
    """
    if name not in DATASETS:
        raise ConfigError(f"data fetch: no data set {name!r} (known: {', '.join(DATASETS)})")
    ds = DATASETS[name]
    to = Path(to)
    dest = to / ds.name
    if dest.exists():
        if dest.is_dir() and is_complete(dest, ds):
            say(f"{dest} already holds {ds.name}; nothing downloaded")
            _licence(ds, say)
            return dest
        raise ConfigError(f"data fetch: {dest} exists but is not a complete copy of {ds.name} "
                          f"(it needs {', '.join(ds.files)}); it was left as it is: remove it "
                          f"or give another --to")
    if to.exists() and not to.is_dir():
        raise ConfigError(f"data fetch: --to {to} is a file; give a folder (created if missing)")
    url = url or ds.url
    if urllib.parse.urlsplit(url).scheme not in ("http", "https", "file"):
        raise ConfigError(f"data fetch: --url must be an http://, https:// or file:// address, "
                          f"got {url!r}")
    expected = (sha256 or ds.sha256).strip().lower()
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise ConfigError(f"data fetch: --sha256 must be 64 hexadecimal digits, got {sha256!r}")
    md5 = ds.md5 if expected == ds.sha256 else None

    made = _make_folders(to)
    archive = unpacking = None
    done = False
    try:
        archive = _temporary(lambda: tempfile.mkstemp(dir=to, prefix=f".{ds.name}-",
                                                      suffix=".zip.part"), to)
        say(f"downloading {url}")
        size = _download(url, archive, expected, md5, timeout)
        unpacking = _temporary(lambda: (None, tempfile.mkdtemp(dir=to, prefix=f".{ds.name}-",
                                                               suffix=".unpacking")), to)
        root = _unpack(archive, unpacking, ds, url)
        try:
            os.rename(root, dest)
        except OSError as e:
            if dest.exists():
                raise ConfigError(f"data fetch: {dest} appeared while downloading; it was left "
                                  f"as it is") from e
            raise _output_error(dest, e) from e
        done = True
    finally:
        if archive is not None:
            archive.unlink(missing_ok=True)
        if unpacking is not None:
            shutil.rmtree(unpacking, ignore_errors=True)
        if not done:
            for folder in made:  # deepest first; only those this call made, left empty
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    say(f"fetched {ds.name} ({size:,} bytes, SHA-256 {expected[:12]}... checked) into {dest}")
    _licence(ds, say)
    return dest


def _licence(ds: Dataset, say: Callable[[str], None]) -> None:
    say(f"{ds.name} licence: {ds.licence}")
    say(f"cite: {ds.cite}")


def _make_folders(to: Path) -> list[Path]:
    """Create ``to`` and its missing parents; return those created, deepest first."""
    made = [p for p in [to, *to.absolute().parents] if not p.exists()]
    try:
        to.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(to, e) from e
    return made


def _temporary(make: Callable[[], tuple[int | None, str]], to: Path) -> Path:
    """A temporary file or folder made by ``make`` (``mkstemp`` / ``mkdtemp``) in ``to``."""
    try:
        fd, path = make()
    except OSError as e:
        raise _output_error(to, e) from e
    if fd is not None:
        os.close(fd)
    return Path(path)


def _download(url: str, path: Path, sha256: str, md5: str | None, timeout: float) -> int:
    """Write what ``url`` serves to ``path``, checking its length and checksums; returns its
    size in bytes."""
    hashes = {"SHA-256": (hashlib.sha256(), sha256)}
    if md5:
        hashes["MD5"] = (hashlib.md5(usedforsecurity=False), md5)
    got = 0
    length = None
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "bigbatch-data-fetch"})
        with urllib.request.urlopen(request, timeout=timeout) as response, \
                open(path, "wb") as out:
            length = response.headers.get("Content-Length")
            while block := response.read(BLOCK):
                _write(out, block, path)
                got += len(block)
                for h, _ in hashes.values():
                    h.update(block)
    except urllib.error.HTTPError as e:
        raise FetchError(f"data fetch: {url} answered {e.code} {e.reason}; check the address "
                         f"(--url), or download the archive elsewhere and give --url "
                         f"file:///path/to/it") from e
    except (urllib.error.URLError, socket.timeout, ConnectionError, http.client.HTTPException) as e:
        if isinstance(e, http.client.IncompleteRead):  # the server closed the connection
            raise _truncated(url, got, int(length) if length and length.isdigit() else None) from e
        reason = getattr(e, "reason", None) or e
        raise FetchError(f"data fetch: could not download {url}: {reason}. Is this machine "
                         f"online? Without a network, download the archive elsewhere, copy it "
                         f"here and give --url file:///path/to/it (its checksum is still "
                         f"checked)") from e
    if length is not None and length.isdigit() and int(length) != got:
        raise _truncated(url, got, int(length))
    for what, (h, want) in hashes.items():
        if h.hexdigest() != want:
            raise FetchError(f"data fetch: the {what} of what {url} served ({got:,} bytes) is "
                             f"{h.hexdigest()}, not the expected {want}: a different or damaged "
                             f"file, so nothing was unpacked. Try again; if you trust this copy, "
                             f"give its SHA-256 with --sha256")
    return got


def _truncated(url: str, got: int, expected: int | None) -> FetchError:
    of = f" of {expected:,}" if expected else ""
    return FetchError(f"data fetch: the download of {url} stopped after {got:,}{of} bytes (the "
                      f"connection closed early); nothing was unpacked. Try again")


def _write(out: BinaryIO, block: bytes, path: Path) -> None:
    """Write ``block`` to ``out`` (the file at ``path``); a failed write raises
    :class:`OutputError` naming the folder and its free space."""
    try:
        out.write(block)
    except OSError as e:
        raise _output_error(path.parent, e) from e


def _unpack(archive: Path, folder: Path, ds: Dataset, url: str) -> Path:
    """Unpack the zip ``archive`` into ``folder``; return the folder in it that holds the data
    set (the archive's top folder, or ``folder`` itself)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [m for m in zf.infolist()
                       if not m.is_dir() and not m.filename.startswith("__MACOSX/")]
            need = sum(m.file_size for m in members)
            free = _free_bytes(folder)
            if free is not None and need > free:
                raise OutputError(f"data fetch: unpacking {ds.name} needs {need / 1e6:,.1f} MB, "
                                  f"but {folder.parent} has {free / 1e6:,.1f} MB free; free "
                                  f"some space or give another --to")
            for m in members:
                target = folder.joinpath(*_safe_parts(m.filename, url))
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise _output_error(folder.parent, e) from e
                with zf.open(m) as src, open(target, "wb") as out:
                    while block := src.read(BLOCK):
                        _write(out, block, target)
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as e:
        raise FetchError(f"data fetch: what {url} served is not a whole zip archive ({e}); "
                         f"nothing was unpacked. Try again") from e
    for root in (folder, *sorted(p for p in folder.iterdir() if p.is_dir())):
        if is_complete(root, ds):
            return root
    raise FetchError(f"data fetch: the archive from {url} holds no {ds.name} folder (one with "
                     f"{', '.join(ds.files)}); nothing was unpacked")


def _safe_parts(name: str, url: str) -> tuple[str, ...]:
    """The parts of a member's name, refused when it would land outside the folder."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or not path.parts or ":" in path.parts[0]:
        raise FetchError(f"data fetch: the archive from {url} holds a file named {name!r}, "
                         f"outside its folder; nothing was unpacked")
    return path.parts


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _output_error(path: Path, e: OSError) -> OutputError:
    free = _free_bytes(path if path.exists() else path.parent)
    space = f" ({free / 1e6:,.1f} MB free there)" if free is not None else ""
    hint = ("is the disk full? Free some space or give another --to"
            if e.errno in (errno.ENOSPC, errno.EDQUOT) else "give a folder you can write (--to)")
    return OutputError(f"data fetch: could not write in {path}: {e.strerror or e}{space}; "
                       f"{hint}; nothing was left behind")
