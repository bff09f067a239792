"""Checkpoints in object stores: `s3://bucket/prefix` and `gs://bucket/prefix`, read through fsspec
(s3fs, gcsfs) with the store's usual credentials (AWS's environment and config files,
`AWS_ENDPOINT_URL` for an S3-compatible server; Google's application default credentials).

The prefix holds a Hugging Face checkpoint; only the files the server loads are copied
(engine.formats.checkpoint_files) into one cache entry per (URI, listing): the entry's name carries a
digest of every file's name, size and ETag / generation, so a checkpoint rewritten in place gets a
new entry instead of a stale one. When the store cannot be listed, the newest complete entry of the
URI is served, with a warning. Pure Python and fsspec (no jax).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Callable

import fsspec

from engine.formats.checkpoint_files import needed_files

logger = logging.getLogger(__name__)

SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
"""URI scheme -> the fsspec package that reads it."""


def is_uri(spec: str) -> bool:
    return spec.split("://", 1)[0] in SCHEMES and "://" in spec


def entry_prefix(uri: str) -> str:
    """Every cache entry of `uri` starts with this (the scheme, the last path part, a digest of the URI)."""
    scheme, rest = uri.rstrip("/").split("://", 1)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", rest.rsplit("/", 1)[-1]) or "bucket"
    return f"{scheme}-{name}-{hashlib.sha256(uri.rstrip('/').encode()).hexdigest()[:8]}"


def plan(uri: str) -> tuple[str, Callable[[Path], None]]:
    """(cache entry name, build(out) that copies the checkpoint into `out`) for `uri`, from a listing.
    Raises ConnectionError (from the store) when it cannot be listed."""
    fs, root = _filesystem(uri)
    try:
        listing = fs.find(root, detail=True)
    except FileNotFoundError:
        listing = {}
    except Exception as exc:  # credentials, network, permissions: the caller may fall back to the cache
        raise ConnectionError(f"cannot list {uri}: {exc}") from exc
    files = {path[len(root):].lstrip("/"): info for path, info in listing.items() if info.get("type") != "directory"}
    names = needed_files(list(files))
    if "config.json" not in names:
        raise ValueError(f"{uri} holds no config.json ({len(files)} objects under it): point `model` at the prefix "
                         "that holds a Hugging Face checkpoint (config.json, *.safetensors, tokenizer files)")
    fingerprint = "\0".join(f"{n}\0{files[n].get('size')}\0{_version(files[n])}" for n in names)
    entry = f"{entry_prefix(uri)}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:8]}"
    return entry, lambda out: _download(fs, root, uri, {n: files[n].get("size") or 0 for n in names}, out)


def _filesystem(uri: str):
    scheme = uri.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(uri.rstrip("/"))
    except ImportError as exc:
        raise ValueError(f"reading {scheme}:// checkpoints needs the {SCHEMES[scheme]} package ({exc}): "
                         f"pip install {SCHEMES[scheme]}") from None


def _version(info: dict) -> str:
    """What changes when an object is rewritten: S3's ETag, GCS's generation, else the modified time."""
    for key in ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime", "updated"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _download(fs, root: str, uri: str, sizes: dict[str, int], out: Path) -> None:
    total = sum(sizes.values())
    logger.info("fetching %s: %d files, %.2f GB", uri, len(sizes), total / 1e9)
    start = time.perf_counter()
    for name in sizes:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
    # one call: fsspec's async stores copy the files concurrently
    fs.get([f"{root}/{name}" for name in sizes], [str(out / name) for name in sizes])
    seconds = time.perf_counter() - start
    logger.info("fetched %s in %.1f s (%.0f MB/s)", uri, seconds, total / 1e6 / max(seconds, 1e-9))
