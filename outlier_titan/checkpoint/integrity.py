"""Checksums of a checkpoint's files, written with it and verified before it is loaded.

Each rank hashes the DCP shards it wrote (``__<rank>_<k>.distcp``) right after ``dcp.save``; rank 0 adds
``.metadata``, ``config.toml`` and ``meta.json`` and writes ``checksums.json`` into the folder before the atomic
rename that commits it. The hash is xxHash's XXH3-128 (non-cryptographic: it detects damage, not tampering).
A checkpoint without ``checksums.json`` (written before this existed) loads unverified. ``checkpoint.verify =
false`` skips the check (rank 0 reads every file of the checkpoint once at start-up: seconds per GiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

CHECKSUMS = "checksums.json"
ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """The XXH3-128 hex digest of a file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, "xxh3_128": digest}}`` of the named files in ``folder``."""
    return {n: {"bytes": (folder / n).stat().st_size, ALGORITHM: file_digest(folder / n)} for n in names}


def own_shards(folder: Path, rank: int) -> list[str]:
    """The DCP data files this rank wrote into ``folder`` (DCP names them ``__<rank>_<k>.distcp``)."""
    return sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))


def write(folder: Path, files: dict[str, dict]) -> None:
    (folder / CHECKSUMS).write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1, sort_keys=True))


def problem(folder: Path) -> str | None:
    """What is wrong with the checkpoint in ``folder`` against its ``checksums.json`` (a missing, resized or
    changed file, or an unreadable list), or None when it matches or has no list."""
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return None
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"its {CHECKSUMS} is unreadable"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size:,} bytes, {want['bytes']:,} were written"
        if file_digest(path) != want[ALGORITHM]:
            return f"{name} does not match its checksum (damaged on disk)"
    return None
