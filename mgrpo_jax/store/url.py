"""Store URLs: ``memory://name[/prefix]``, ``file:///abs/path``, ``gs://bucket/prefix``.

A URL is turned into a TensorStore kvstore spec rooted at the store's own prefix (always ending in ``/``);
every key the store touches is relative to that root, so nothing outside it is ever read or deleted.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

SCHEMES = ("memory", "file", "gs")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._=+@,-]+$")


@dataclasses.dataclass(frozen=True)
class StoreLocation:
    """A parsed store URL.

    Attributes:
      url: the canonical URL, ending in ``/`` (used in messages: ``url + key`` names an object).
      scheme: ``memory``, ``file`` or ``gs``.
      bucket: the GCS bucket (``gs`` only), else ``""``.
      root: the path prefix inside the driver, ending in ``/`` (``""`` for a whole bucket).
    """

    url: str
    scheme: str
    bucket: str
    root: str

    def kvstore_spec(self, key_prefix: str = "") -> dict:
        """TensorStore kvstore spec for ``root + key_prefix``."""
        path = self.root + key_prefix
        if self.scheme == "memory":
            return {"driver": "memory", "path": path}
        if self.scheme == "file":
            return {"driver": "file", "path": path}
        return {"driver": "gcs", "bucket": self.bucket, "path": path}


def _check_segments(url: str, path: str) -> list[str]:
    segments = [s for s in path.split("/") if s]
    for seg in segments:
        if seg in (".", "..") or not _SEGMENT_RE.match(seg):
            raise ValueError(
                f"store URL {url!r}: invalid path segment {seg!r} (allowed: letters, digits, ._=+@,-)"
            )
    return segments


def parse_store_url(url: str) -> StoreLocation:
    """Parses and validates a store URL; raises ValueError naming the URL on anything malformed."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        raise ValueError(
            f"store URL {url!r} has no scheme; expected one of " + ", ".join(f"{s}://" for s in SCHEMES)
        )
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"store URL {url!r}: unknown scheme {parts.scheme!r}; expected one of {', '.join(SCHEMES)}"
        )
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"store URL {url!r}: query strings and fragments are not allowed")
    if scheme == "memory":
        segments = _check_segments(url, (parts.netloc or "default") + "/" + parts.path)
        root = "/".join(segments) + "/"
        return StoreLocation(url=f"memory://{root}", scheme="memory", bucket="", root=root)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"store URL {url!r}: file URLs must be file:///absolute/path (got host {parts.netloc!r})"
            )
        if not parts.path.startswith("/"):
            raise ValueError(f"store URL {url!r}: file URLs need an absolute path")
        segments = _check_segments(url, parts.path)
        if not segments:
            raise ValueError(f"store URL {url!r}: refusing to use the filesystem root as a store")
        root = "/" + "/".join(segments) + "/"
        return StoreLocation(url=f"file://{root}", scheme="file", bucket="", root=root)
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket or "") or ".." in bucket:
        raise ValueError(f"store URL {url!r}: invalid GCS bucket name {bucket!r}")
    segments = _check_segments(url, parts.path)
    root = "/".join(segments) + "/" if segments else ""
    return StoreLocation(url=f"gs://{bucket}/{root}", scheme="gs", bucket=bucket, root=root)
