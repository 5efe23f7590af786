"""Datasets given as URLs: fetched once into a cache, whole or not at all.

``--dataset https://host/rows.jsonl`` (or ``.parquet``) is downloaded into
``$GRPO_CORE_CACHE/datasets`` (default ``~/.cache/grpo-core``), one folder per URL, within a
deadline (``--fetch-timeout``), with a progress bar for a large file. The body goes to a
``.part`` file that replaces the cached copy only once it is whole and looks like a dataset: a
failure (an unreachable host, an HTTP error, the deadline, an HTML page, Ctrl-C) leaves the
cache as it was. A new run fetches again (the URL may serve new rows); a resumed run reads the
cached copy, and the rows' sha256 in ``data.json`` refuses it if it changed, as for a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import attrs

from grpo_core.errors import DataError

URL = re.compile(r"^https?://", re.IGNORECASE)
PROGRESS_BYTES = 16 * 2**20
"""A download at least this large (or of unknown size) shows a progress bar."""
CHUNK_BYTES = 2**20
SNIFF_BYTES = 4096
"""How much of a JSONL body's start is read to tell rows from a web page."""


@attrs.frozen
class Fetched:
    """A dataset URL and the cached file its rows are read from: what ``data.json`` records."""

    url: str
    path: Path
    sha256: str

    def record(self) -> dict[str, str]:
        return {"url": self.url, "sha256": self.sha256, "cached": str(self.path)}


def is_url(dataset: str) -> bool:
    return bool(URL.match(dataset))


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_CORE_CACHE", Path.home() / ".cache" / "grpo-core")) / "datasets"


def cached_path(url: str) -> Path:
    """Where ``url``'s body is kept: a folder per URL, the file named as the URL's path ends."""
    name = Path(unquote(urlsplit(url).path)).name
    if not re.fullmatch(r"[\w.-]+", name) or name.startswith("."):
        name = "rows.jsonl"
    return cache_root() / hashlib.sha256(url.encode()).hexdigest()[:24] / name


def is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


def fetch(url: str, timeout: float, refetch: bool) -> Fetched:
    """``url``'s rows in the cache: fetched when ``refetch`` or when none are cached yet."""
    path = cached_path(url)
    if path.is_file() and not refetch:
        return Fetched(url, path, file_sha256(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        sha256 = _download(url, part, timeout)
        _check_body(url, part, is_parquet(path))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
        if not any(path.parent.iterdir()):
            path.parent.rmdir()
    return Fetched(url, path, sha256)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, part: Path, timeout: float) -> str:
    """Stream ``url``'s body into ``part`` within ``timeout`` seconds; its sha256."""
    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    deadline = time.monotonic() + timeout
    digest = hashlib.sha256()
    try:
        with httpx.stream("GET", url, timeout=timeout, follow_redirects=True) as response:
            if response.status_code != 200:
                raise DataError(f"{url}: the server answered HTTP {response.status_code} {response.reason_phrase}; no dataset was fetched")
            if response.headers.get("content-type", "").startswith("text/html"):
                raise DataError(f"{url}: the server sent a web page (text/html), not JSONL or Parquet rows")
            size = int(response.headers.get("content-length", 0)) or None
            columns = (TextColumn(f"fetching {url}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
            with Progress(*columns, console=Console(stderr=True), disable=size is not None and size < PROGRESS_BYTES) as bar:
                task = bar.add_task("fetch", total=size)
                with part.open("wb") as f:
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        if time.monotonic() > deadline:
                            raise DataError(f"{url}: not fetched within --fetch-timeout {timeout:g} s; raise it for a large file")
                        f.write(chunk)
                        digest.update(chunk)
                        bar.advance(task, len(chunk))
    except httpx.TimeoutException:
        raise DataError(f"{url}: not fetched within --fetch-timeout {timeout:g} s (the server stopped answering)") from None
    except httpx.HTTPError as exc:
        raise DataError(f"{url}: cannot fetch it ({type(exc).__name__}: {exc or 'no reason given'})") from None
    return digest.hexdigest()


def _check_body(url: str, part: Path, parquet: bool) -> None:
    """Refuse a body that is no dataset before it replaces the cached copy (the rows are checked whole later)."""
    with part.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    if parquet:
        if not head.startswith(b"PAR1"):
            raise DataError(f"{url}: the body is not a Parquet file (it does not start with PAR1)")
        return
    first = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if not first:
        raise DataError(f"{url}: the body is empty; no dataset was fetched")
    line = first.split(b"\n", 1)[0]
    if b"\n" not in first and len(head) == SNIFF_BYTES and first.startswith(b"{"):
        return  # a first row longer than the bytes read: the loader checks it whole
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        row = None
    if not isinstance(row, dict):
        shown = line[:60].decode("utf-8", "replace")
        raise DataError(f"{url}: the body is not JSONL rows (its first line is {shown!r}); give a .jsonl or .parquet URL")
