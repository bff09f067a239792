"""Checkpoints on the Hugging Face Hub, or on any server that speaks its download API (`HF_ENDPOINT`).

A repo id (`org/name`, optional revision: a branch, tag or commit) is downloaded once into the
standard Hugging Face cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub), where transformers
and every other tool find it too; only the files the server loads (engine.formats.checkpoint_files).
Each file is logged as it arrives. The token is huggingface_hub's: `HF_TOKEN`, else the one `hf auth
login` saved. With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the cached snapshot of the
revision is served if the cache has it; otherwise the error says what to change.

Invariant: the directory returned holds every file of one commit (a branch that moves during the
download is an error, not a mix of two commits).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Optional

from requests.exceptions import ConnectionError as Unreachable
from requests.exceptions import Timeout

from engine.formats.checkpoint_files import needed_files, tokenizer_files

logger = logging.getLogger(__name__)

_PARALLEL_FILES = 8
_INFO_TIMEOUT_S = 10.0
"""How long building an app waits for the Hub's answer about a repo (then it reads the cache)."""


def fetch(repo_id: str, revision: Optional[str] = None, tokenizer_only: bool = False) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloaded if needed:
    the checkpoint, or only its tokenizer files."""
    where = f"{repo_id}@{revision or 'main'}"
    try:
        info = _model_info(repo_id, revision)
    except (ConnectionError, Unreachable, Timeout) as exc:  # offline mode raises a ConnectionError
        return _cached_snapshot(repo_id, revision, where, exc)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    files = (tokenizer_files if tokenizer_only else needed_files)(list(sizes))
    if tokenizer_only and not {"tokenizer.json", "tokenizer_config.json"} & set(files):
        raise ValueError(f"{where} has no tokenizer.json or tokenizer_config.json: it holds no tokenizer")
    if not tokenizer_only and "config.json" not in files:
        raise ValueError(f"{where} has no config.json: it is not a Hugging Face model checkpoint")
    return _download(repo_id, revision, info.sha, {name: sizes[name] for name in files})


def fetch_files(repo_id: str, revision: Optional[str], names: tuple[str, ...]) -> Path:
    """A snapshot directory of `repo_id` at `revision` holding those of `names` the repo has
    (config.json among them), downloaded alone if needed: what a model's task is read from before
    its weights are fetched. With the Hub out of reach, the cached snapshot (whatever it holds)."""
    where = f"{repo_id}@{revision or 'main'}"
    try:
        info = _model_info(repo_id, revision, timeout=_INFO_TIMEOUT_S)
    except (ConnectionError, Unreachable, Timeout) as exc:
        return _cached_snapshot(repo_id, revision, where, exc)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    if "config.json" not in sizes:
        raise ValueError(f"{where} has no config.json: it is not a Hugging Face model checkpoint")
    return _download(repo_id, revision, info.sha, {name: sizes[name] for name in names if name in sizes})


def _model_info(repo_id: str, revision: Optional[str], timeout: Optional[float] = None):
    """The Hub's ModelInfo of `repo_id` at `revision`, with its files' sizes; a ValueError saying what
    to change for a gated, unknown or private repo or an unknown revision. An unreachable Hub (or
    offline mode, or no answer within `timeout` seconds) raises its ConnectionError / Timeout."""
    # huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and the token when imported: import it when a fetch starts
    from huggingface_hub import HfApi, constants
    from huggingface_hub import errors as hub_errors

    try:
        return HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout)
    except hub_errors.GatedRepoError:
        raise ValueError(f"{repo_id} on {constants.ENDPOINT} is gated: accept its terms on the Hub with "
                         "your account and set HF_TOKEN to a token of that account") from None
    except hub_errors.RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r} is not a local directory, and {constants.ENDPOINT} has no repo "
                         "of that name that this token may read: check the name, or set HF_TOKEN to a token "
                         "that can read it (a private repo)") from None
    except hub_errors.RevisionNotFoundError:
        raise ValueError(f"{repo_id} has no revision {revision!r} on {constants.ENDPOINT}: set `revision` to a "
                         "branch, tag or commit of that repo") from None


def _download(repo_id: str, revision: Optional[str], commit: str, sizes: dict[str, int]) -> Path:
    """Download `sizes`' files of `repo_id` (in parallel, each logged); the snapshot directory."""
    from huggingface_hub import hf_hub_download  # read its settings when a fetch starts (see `fetch`)

    where = f"{repo_id}@{revision or 'main'}"
    total = sum(sizes.values())
    logger.info("fetching %s (commit %s): %d files, %.2f GB", where, commit[:12], len(sizes), total / 1e9)
    start, done = time.perf_counter(), 0
    paths = {}
    with concurrent.futures.ThreadPoolExecutor(_PARALLEL_FILES) as pool:
        # the branch name (not the commit) so that the cache records it for offline use
        futures = {pool.submit(hf_hub_download, repo_id, name, revision=revision): name for name in sizes}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            paths[name] = Path(future.result())
            done += sizes[name]
            logger.info("fetched %s: %s (%.1f MB), %.0f%% of %.2f GB after %.1f s", where, name, sizes[name] / 1e6,
                        100 * done / max(total, 1), total / 1e9, time.perf_counter() - start)
    snapshots = {paths[name].parents[len(Path(name).parts) - 1] for name in paths}
    if len(snapshots) != 1:
        raise RuntimeError(f"{where} moved to another commit while it was downloading; start again")
    snapshot = snapshots.pop()
    logger.info("fetched %s into %s in %.1f s", where, snapshot, time.perf_counter() - start)
    return snapshot


def _cached_snapshot(repo_id: str, revision: Optional[str], where: str, reason: Exception) -> Path:
    """The cached snapshot of `repo_id` at `revision` when the Hub is out of reach (or offline mode)."""
    # huggingface_hub's settings, read when it is imported (see `fetch`)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else f"{constants.ENDPOINT} is out of reach ({reason})")
        raise ValueError(f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
                         "download it once with the Hub reachable (or copy the cache), or point `model` at a "
                         "local checkpoint directory") from None
    logger.info("serving %s from the Hugging Face cache (%s): %s", where, type(reason).__name__, path)
    return path
