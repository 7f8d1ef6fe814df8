"""Records: JSON objects that carry who made them (step, query, rollout, invocation, policy version).

On disk a record is one JSON object with a sha256 over its canonical encoding, so a truncated or damaged
object is detected on read instead of being trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from mgrpo_jax.store.errors import CorruptRecordError
from mgrpo_jax.store.kv import dumps

FORMAT = "mgrpo_store/1"
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
MAX_QUERY = 10**6
MAX_ROLLOUT = 10**4
MAX_INVOCATION = 10**4
MAX_STEP = 10**10


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"invalid {what} {name!r}: use lowercase letters, digits and '_' (start with a letter)"
        )
    return name


def check_int(what: str, value: Any, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < upper:
        raise ValueError(f"invalid {what} {value!r}: expected an int in [0, {upper})")
    return value


def step_dir(step: int) -> str:
    return f"{check_int('step', step, MAX_STEP):010d}"


def record_id(query: int, rollout: int, invocation: int) -> str:
    """The id of a (query, rollout, invocation) slot, e.g. ``q000003-r0001-i0002``; sorts in slot order."""
    return (
        f"q{check_int('query', query, MAX_QUERY):06d}"
        f"-r{check_int('rollout', rollout, MAX_ROLLOUT):04d}"
        f"-i{check_int('invocation', invocation, MAX_INVOCATION):04d}"
    )


_ID_RE = re.compile(r"^q(\d{6})-r(\d{4})-i(\d{4})$")


def parse_record_id(rid: str) -> tuple[int, int, int]:
    match = _ID_RE.match(rid) if isinstance(rid, str) else None
    if not match:
        raise ValueError(f"invalid record id {rid!r}: expected 'qNNNNNN-rNNNN-iNNNN'")
    return int(match[1]), int(match[2]), int(match[3])


@dataclasses.dataclass(frozen=True)
class Record:
    """One record. ``invocation`` is the sub-agent call index within the rollout (0 for per-rollout records).

    ``payload`` is any JSON-serialisable dict (text, token ids, scalars). ``policy_version`` is the version
    of the policy that produced the record, so the consumer can measure staleness.
    """

    kind: str
    step: int
    query: int
    rollout: int
    invocation: int
    policy_version: int
    payload: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_name("record kind", self.kind)
        check_int("step", self.step, MAX_STEP)
        check_int("policy_version", self.policy_version, 2**62)
        record_id(self.query, self.rollout, self.invocation)
        if not isinstance(self.payload, dict):
            raise ValueError(f"record payload must be a dict, got {type(self.payload).__name__}")

    @property
    def id(self) -> str:
        return record_id(self.query, self.rollout, self.invocation)

    def header(self) -> dict:
        return {
            "kind": self.kind,
            "step": self.step,
            "query": self.query,
            "rollout": self.rollout,
            "invocation": self.invocation,
            "policy_version": self.policy_version,
        }

    def encode(self) -> bytes:
        try:
            return seal({**self.header(), "payload": self.payload})
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"record {self.kind}/{self.step}/{self.id}: payload is not JSON-serialisable: {exc}"
            ) from exc

    @classmethod
    def decode(cls, raw: bytes, *, url: str = "", key: str = "") -> Record:
        body = unseal(raw, url=url, key=key)
        try:
            return cls(
                kind=body["kind"],
                step=body["step"],
                query=body["query"],
                rollout=body["rollout"],
                invocation=body["invocation"],
                policy_version=body["policy_version"],
                payload=body["payload"],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptRecordError(f"corrupt or partial record ({exc})", url=url, key=key) from exc


def seal(body: dict) -> bytes:
    """Canonical JSON of ``body`` plus ``format`` and a sha256 over the rest (see ``unseal``)."""
    body = {"format": FORMAT, **body}
    return dumps({**body, "sha256": hashlib.sha256(dumps(body)).hexdigest()})


def unseal(raw: bytes, *, url: str = "", key: str = "") -> dict:
    """Decodes what ``seal`` wrote; a truncated, edited or foreign object raises CorruptRecordError."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        digest = body.pop("sha256")
        if body.get("format") != FORMAT:
            raise ValueError(f"unknown format {body.get('format')!r}")
        if hashlib.sha256(dumps(body)).hexdigest() != digest:
            raise ValueError("checksum mismatch")
        return body
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecordError(f"corrupt or partial store object ({exc})", url=url, key=key) from exc
