"""Named seeds: every random draw of a run (rollouts, alignment, demonstrations, evaluation) takes its seed from
the run seed and a few names, so a resumed or decoupled run draws exactly what the uninterrupted colocated one does."""

import zlib


def derive_seed(*parts) -> int:
    """A 31-bit seed from the run seed and names, e.g. `derive_seed(config.seed, "rollout", step)`."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF
