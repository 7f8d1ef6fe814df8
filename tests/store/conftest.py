"""Store test fixtures: a store URL per backend (memory://, file://, gs:// over a local GCS emulator).

The emulator is ``gcp-storage-emulator`` started through ``emulator_launcher.py`` (which fixes its
``objects.list`` offsets and generation preconditions) on 127.0.0.1 at a free port, once per session and
only when a gs:// test runs. The endpoint variables are set here, at import, before anything imports gcsfs.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mgrpo_jax.bench.store import stop_emulator

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUCKET = "mgrpo-test"
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EMULATOR_PORT = free_port()
EMULATOR_URL = f"http://127.0.0.1:{EMULATOR_PORT}"
# TensorStore and gcsfs read these from the environment; gcsfs needs them before it is imported.
os.environ["TENSORSTORE_GCS_HTTP_URL"] = EMULATOR_URL
os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "dummy"
os.environ["STORAGE_EMULATOR_HOST"] = EMULATOR_URL
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

BACKENDS = ("memory", "file", "gs")


def subprocess_env(emulator_url: str | None = None) -> dict[str, str]:
    """Environment for child processes: the repo on the path and the emulator settings (this session's
    emulator, or the one at ``emulator_url``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if emulator_url:
        env.update({"TENSORSTORE_GCS_HTTP_URL": emulator_url, "STORAGE_EMULATOR_HOST": emulator_url})
    return env


def emulator_listening() -> bool:
    """True when something accepts connections on the emulator port (e.g. this session's emulator)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", EMULATOR_PORT)) == 0


def start_emulator(port: int = EMULATOR_PORT, data_dir: Path | None = None) -> subprocess.Popen:
    """Starts the patched emulator on ``port`` (on-disk under ``data_dir`` if given); returns once it listens."""
    cmd = [sys.executable, str(HERE / "emulator_launcher.py"), "--port", str(port), "--bucket", BUCKET]
    if data_dir is not None:
        cmd += ["--data-dir", str(data_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env())
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else f"nothing in {START_TIMEOUT_S} s"
    if not line.startswith("READY"):
        stop_emulator(proc)
        raise RuntimeError(f"GCS emulator did not start (said {line!r}, exit code {proc.poll()})")
    return proc


@contextlib.contextmanager
def running_emulator():
    """Runs the patched emulator on EMULATOR_PORT while the block runs; yields its base URL."""
    proc = start_emulator()
    try:
        yield EMULATOR_URL
    finally:
        stop_emulator(proc)


@contextlib.contextmanager
def shared_emulator():
    """This session's emulator when it already runs (same port), else one for the block; yields its base URL."""
    if emulator_listening():
        yield EMULATOR_URL
    else:
        with running_emulator() as url:
            yield url


@pytest.fixture(scope="session")
def gcs_emulator():
    """Starts the patched emulator for the session; yields its base URL."""
    with running_emulator() as url:
        yield url


def make_url(backend: str, request, tmp_path: Path, name: str = "store") -> str:
    unique = uuid.uuid4().hex[:12]
    if backend == "memory":
        return f"memory://{name}-{unique}"
    if backend == "file":
        return (tmp_path / name).as_uri()
    request.getfixturevalue("gcs_emulator")
    return f"gs://{BUCKET}/{unique}/{name}"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store_url(backend, request, tmp_path) -> str:
    """A fresh, empty store URL on each backend."""
    return make_url(backend, request, tmp_path)


@pytest.fixture
def fast_poll():
    from mgrpo_jax.store import PollPolicy

    return PollPolicy(initial_s=0.005, max_s=0.05)
