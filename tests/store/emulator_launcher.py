"""Start ``gcp-storage-emulator`` with a fixed ``objects.list`` handler (test-only).

The emulator (2026.7.19) ignores the ``startOffset``/``endOffset`` parameters of ``objects.list``.
TensorStore uses them for range listing and ``delete_range``, so against the stock emulator a range delete
on ``gs://bucket/prefix/`` deletes every object in the bucket. This launcher wraps the list handler so it
filters items (and prefixes) by those two parameters. The emulator also ignores the
``ifGenerationMatch`` precondition on uploads and deletes, which real GCS honours and the store's
conditional writes (first writer wins, task claims) rely on, and sends no ``x-goog-generation`` header
with downloads (so every read looks like generation 0); the launcher adds both (the
launcher serialises request handling, so check-then-write is atomic), and serves connections on
threads. Then it starts the server:

    python tests/store/emulator_launcher.py --port PORT --bucket NAME [--data-dir DIR]

It prints ``READY <port>`` on stdout once the server accepts connections (``FAILED ...`` and exit code 1
if it cannot listen, e.g. the port is taken). Without ``--data-dir`` the emulator keeps objects in memory;
with it, a restart on the same directory keeps the bucket. SIGTERM stops it between two requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time


def _query_param(request, name: str) -> str | None:
    values = request.query.get(name)
    return values[0] if values else None


def patch_list_handler() -> None:
    """Replace the emulator's ``objects.ls`` with one that honours startOffset/endOffset."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    original = getattr(objects.ls, "__wrapped_original__", objects.ls)

    def ls(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        start = _query_param(request, "startOffset")
        end = _query_param(request, "endOffset")
        if (start is None and end is None) or response.status.value != 200:
            return

        def inside(name: str) -> bool:
            return (start is None or name >= start) and (end is None or name < end)

        body = json.loads(response._content)
        body["items"] = [item for item in body.get("items", []) if inside(item.get("name", ""))]
        body["prefixes"] = [p for p in body.get("prefixes", []) if inside(p)]
        response.json(body)

    ls.__wrapped_original__ = original
    objects.ls = ls
    # The route table was built at import time and holds the old function object: swap it there too.
    for _regex, methods in server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler is original:
                methods[method] = ls


def patch_generation_preconditions() -> None:
    """Make media uploads and deletes honour ``ifGenerationMatch`` (412 on mismatch, 0 = must not exist)."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def current_generation(storage, bucket: str, name: str) -> int:
        try:
            return int(storage.get_file_obj(bucket, name).get("generation", 0))
        except NotFound:
            return 0

    def guarded(original, name_of):
        def handler(request, response, storage, *args, **kwargs):
            expected = _query_param(request, "ifGenerationMatch")
            name = name_of(request)
            if expected is not None and name is not None:
                bucket = request.params["bucket_name"]
                if current_generation(storage, bucket, name) != int(expected):
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "Precondition Failed"}})
                    return None
            return original(request, response, storage, *args, **kwargs)

        handler.__wrapped_original__ = original
        return handler

    swaps = {}
    for attr, name_of in (
        ("insert", lambda request: _query_param(request, "name")),
        ("delete", lambda request: request.params.get("object_id")),
    ):
        original = getattr(objects, attr)
        original = getattr(original, "__wrapped_original__", original)
        swaps[original] = guarded(original, name_of)
        setattr(objects, attr, swaps[original])
    for _regex, methods in server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler in swaps:
                methods[method] = swaps[handler]


def patch_generation_headers() -> None:
    """Send ``x-goog-generation`` with downloads, as GCS does.

    Without it TensorStore takes every object read from the emulator to be generation 0, so a
    read-then-conditional-write (an offset update, a lease takeover) fails with "Malformed StorageGeneration".
    """
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = getattr(objects.download, "__wrapped_original__", objects.download)

    def download(request, response, storage, *args, **kwargs):
        result = original(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except NotFound:
                return result
            response["x-goog-generation"] = str(obj.get("generation", 0))
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
        return result

    download.__wrapped_original__ = original
    objects.download = download  # objects.get(alt=media) looks it up by name at call time
    for _regex, methods in server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler is original:
                methods[method] = download


REQUEST_LOCK = threading.Lock()  # held while a request is handled (see serve_connections_concurrently)


def serve_connections_concurrently() -> None:
    """Serve each connection on its own thread, but handle one request at a time.

    The stock emulator uses a single-threaded ``HTTPServer``: a client that keeps several keep-alive
    connections open (TensorStore issues requests concurrently) waits on whichever connection the server is
    parked on, and its listen backlog of 5 drops bursts of new connections (a 1 s SYN retransmit): 24
    concurrent writes took over a second. Handling stays serialised by a lock,
    so the emulator's storage and the precondition checks above see one request at a time.
    """
    import http.server
    import types

    from gcp_storage_emulator import server

    class ThreadingServer(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # socketserver's default backlog of 5 drops bursts of new connections

    lock = REQUEST_LOCK
    original = getattr(server.Router.handle, "__wrapped_original__", server.Router.handle)

    def handle(self, method):
        with lock:
            return original(self, method)

    handle.__wrapped_original__ = original
    server.Router.handle = handle
    server.server = types.SimpleNamespace(HTTPServer=ThreadingServer)


def _wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """True once the server thread accepts connections (it binds in the background and may fail to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.05)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    import logging

    logging.getLogger().setLevel(logging.CRITICAL)
    patch_list_handler()
    patch_generation_preconditions()
    patch_generation_headers()
    serve_connections_concurrently()
    from gcp_storage_emulator.handlers.buckets import create_bucket
    from gcp_storage_emulator.server import create_server

    with socket.socket() as probe:  # the emulator's server thread would wait forever on a port that is taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind((args.host, args.port))
        except OSError as error:
            print(f"FAILED to bind {args.host}:{args.port}: {error}", flush=True)
            return 1
    in_memory = args.data_dir is None
    srv = create_server(args.host, args.port, in_memory, None, data_dir=args.data_dir)
    for bucket in args.bucket:
        create_bucket(bucket, srv._storage)  # no-op when it exists (on-disk storage)
    srv.start()
    if not _wait_listening(args.host, args.port, timeout_s=60):
        print(f"FAILED to listen on {args.host}:{args.port}", flush=True)
        return 1

    def stop(signum, frame):
        # Stop between requests, like a server that goes away: no half-written object or metadata file
        # (with --data-dir the emulator rewrites its whole metadata file on every change).
        REQUEST_LOCK.acquire(timeout=30)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"READY {args.port}", flush=True)
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
