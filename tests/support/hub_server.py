"""A local server that speaks the Hugging Face Hub's download API, for tests (`HF_ENDPOINT`).

What huggingface_hub's `model_info` and `hf_hub_download` call: `GET /api/models/{repo}[/revision/{rev}]`
(the commit and its files), `HEAD` / `GET /{repo}/resolve/{rev}/{path}` (commit, ETag, size, bytes),
with the Hub's error codes (RepoNotFound, RevisionNotFound, GatedRepo in `X-Error-Code`). A repo
serves the files of a directory as one commit per branch; a gated repo answers only requests that
carry its token. Every file download is counted, so tests can tell a cache hit from a download.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional


class HubServer:
    """`HubServer()` listens on 127.0.0.1 (a free port) in a thread; `url` is its `HF_ENDPOINT`."""

    def __init__(self):
        self.repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
        """repo id -> branch -> (commit sha, {file name: bytes})."""
        self.tokens: dict[str, str] = {}
        """repo id -> the token a gated repo asks for."""
        self.downloads: collections.Counter = collections.Counter()
        """(repo id, file name) -> GETs of that file."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def add(self, repo_id: str, directory: Path, branch: str = "main", token: Optional[str] = None) -> str:
        """Serve every file under `directory` as the head of `branch`; returns the commit sha."""
        files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode())
        commit = digest.hexdigest()
        self.repos.setdefault(repo_id, {})[branch] = (commit, files)
        if token is not None:
            self.tokens[repo_id] = token
        return commit

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def lookup(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]]:
        """(commit, files) of a branch or a commit sha; KeyError naming what is missing."""
        branches = self.repos[repo_id]
        if revision in branches:
            return branches[revision]
        for commit, files in branches.values():
            if commit == revision:
                return commit, files
        raise KeyError("RevisionNotFound")


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: tests read `hub.downloads`, not the log
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                repo_id, revision = "/".join(parts[2:4]), parts[5] if len(parts) > 5 else "main"
                return self._answer(repo_id, revision, lambda commit, files: self._info(repo_id, commit, files, body))
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                return self._answer(repo_id, revision,
                                    lambda commit, files: self._file(repo_id, commit, files, name, body))
            self._error(404, "RepoNotFound")

        def _answer(self, repo_id: str, revision: str, respond) -> None:
            if repo_id not in hub.repos:
                return self._error(401, "RepoNotFound")  # the Hub answers 401 for unknown and private repos alike
            token = hub.tokens.get(repo_id)
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                return self._error(401, "GatedRepo")
            try:
                commit, files = hub.lookup(repo_id, revision)
            except KeyError:
                return self._error(404, "RevisionNotFound")
            respond(commit, files)

        def _info(self, repo_id: str, commit: str, files: dict[str, bytes], body: bool) -> None:
            siblings = [{"rfilename": name, "size": len(data)} for name, data in files.items()]
            self._send(200, json.dumps({"id": repo_id, "sha": commit, "siblings": siblings}).encode(),
                       {"Content-Type": "application/json"}, body)

        def _file(self, repo_id: str, commit: str, files: dict[str, bytes], name: str, body: bool) -> None:
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name]
            if body:
                hub.downloads[(repo_id, name)] += 1
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            self._send(200, data, headers, body)

        def _error(self, status: int, code: str) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, True)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
