"""Every file a run reads and writes, through one path type (`etils.epath`): a local folder or `gs://bucket/run`.

Object stores have no append and no rename, so the two operations a run needs besides plain reads and writes are
defined here for both kinds of path:
- `AppendFile`: lines appended to a log (metrics, transcripts, `run.log`). Locally an open append handle; remotely
  the lines are kept in memory and the whole object rewritten on `flush` (at most every `flush_every_s` seconds,
  and on `close`): a run's logs are megabytes, and a GCS object write is atomic, so a reader never sees a torn line.
- `write_atomic`: a file replaced whole (summary, curriculum): locally a temporary file and `os.replace`; remotely one
  object write, which is atomic already.
"""

from __future__ import annotations

import io
import logging
import os
import time

from etils import epath

log = logging.getLogger(__name__)


def is_remote(path) -> bool:
    return "://" in os.fspath(path)


def as_path(path) -> epath.Path:
    return epath.Path(path)


def read_text(path) -> str | None:
    """The file's text, or None when it does not exist."""
    path = as_path(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def write_atomic(path, data: str | bytes) -> None:
    """Replaces `path` whole: a reader sees the old content or the new one, never a mix."""
    path = as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(path):
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
        return
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def append_text(path, text: str) -> None:
    """Appends `text` to `path` once (for the occasional record; a log written often keeps an `AppendFile`)."""
    with AppendFile(path) as f:
        f.write(text)


class AppendFile:
    """Text appended to `path`, local or remote (see the module docstring). A context manager."""

    def __init__(self, path, flush_every_s: float = 0.0, durable: bool = False):
        self.path, self.remote, self.flush_every_s = as_path(path), is_remote(path), float(flush_every_s)
        self.durable = durable  # local: fsync on flush, so what was written survives a crash of the machine
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_flush = time.monotonic()
        if self.remote:
            self._text = [read_text(self.path) or ""]
            self._dirty = False
        else:
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, text: str) -> None:
        if self.remote:
            self._text.append(text)
            self._dirty = True
            if time.monotonic() - self._last_flush >= self.flush_every_s:
                self.flush()
            return
        if os.fstat(self._file.fileno()).st_nlink == 0:  # deleted under a running job: lines would vanish
            log.warning("%s was deleted during the run: continuing in a new file", self.path)
            self._file.close()
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._file.write(text)
        if self.flush_every_s == 0 and not self.durable:
            self._file.flush()

    def flush(self) -> None:
        if self.remote:
            if self._dirty:
                self.path.write_text("".join(self._text))
                self._dirty = False
        elif not self._file.closed:
            self._file.flush()
            if self.durable:
                os.fsync(self._file.fileno())
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        if not self.remote:
            self._file.close()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # run.log's, and the launcher's on screen


class LogFileHandler(logging.Handler):
    """A logging handler that appends records to `path`, local or remote (remote: flushed every 10 s and at
    exit)."""

    def __init__(self, path, level=logging.NOTSET):
        super().__init__(level)
        self.file = AppendFile(path, flush_every_s=10.0 if is_remote(path) else 0.0)
        self.baseFilename = str(self.file.path)
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.file.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never fail the run
            self.handleError(record)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        super().close()


class _EventFileWriter:
    """tensorboardX's event-file writer for a remote path: the events are kept and the object rewritten on each
    flush (tensorboardX flushes every `flush_secs`). Its own gs:// writer needs `google-cloud-storage`; this one
    goes through `etils.epath` like every other file of a run."""

    def __init__(self, path: str):
        self.path, self.buffer = as_path(path), io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        self.path.write_bytes(self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _EventFileWriterFactory:
    def open(self, path: str) -> _EventFileWriter:
        return _EventFileWriter(path)

    def directory_check(self, path: str) -> None:
        del path  # object stores have no folders to create


def tensorboard_writer(logdir: str, purge_step: int | None = None):
    """A `tensorboardX.SummaryWriter` on `logdir`, local or `gs://`."""
    from tensorboardX import SummaryWriter, record_writer

    if is_remote(logdir):
        record_writer.register_writer_factory(logdir.split("://", 1)[0], _EventFileWriterFactory())
    return SummaryWriter(logdir=logdir, purge_step=purge_step, flush_secs=10)
