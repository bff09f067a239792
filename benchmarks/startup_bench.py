"""Time to the first chat answer of `serve run deploy/config.yaml`, as a new user meets it.

    .venv/bin/python -m benchmarks.startup_bench --runs 2            # an empty compilation cache, then the one it left
    .venv/bin/python -m benchmarks.startup_bench --repo /path/to/other/checkout   # the same for another checkout
    .venv/bin/python -m benchmarks.startup_bench --runs 3 --floor imports         # Ray Serve's own share

Starts `serve run` on the repository's deploy/config.yaml (models already fetched and converted:
run it once before), with every model's `compilation_cache_dir` pointed at a fresh directory, and
sends the README's chat request every 0.5 s until one is answered; prints the seconds from the
command to that answer, and to `/health` 200. `--runs N` starts N times on the same directory:
the first with an empty cache, the rest with the cache the earlier runs left. The server and its
Ray instance are stopped after each run. `--repo` runs another checkout's code and config with
this machine's venv (for side-by-side figures against an older version). `--floor bare|imports`
runs benchmarks/serve_floor_app.py instead: the default app's shape without a model (see there),
what any application costs `serve run` on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def post(url: str, body: dict, timeout: float = 5.0) -> dict | None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def config_with_cache(repo: Path, cache: Path, port: int) -> Path:
    config = yaml.safe_load((repo / "deploy" / "config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    for model in config["applications"][0]["args"]["models"]:
        model["compilation_cache_dir"] = str(cache)
    path = cache.parent / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def floor_config(work: Path, port: int, imports: bool) -> Path:
    app = {"name": "floor", "route_prefix": "/", "import_path": "benchmarks.serve_floor_app:build_app",
           "runtime_env": {"env_vars": {"USE_TORCH": "0"}}, "args": {"imports": imports}}
    path = work / "floor.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}))
    return path


def one_start(repo: Path, config: Path, port: int, timeout: float) -> tuple[float, float, str]:
    """(seconds to /health 200, seconds to the first chat answer, its text)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    serve = Path(sys.executable).with_name("serve")
    start = time.perf_counter()
    proc = subprocess.Popen([str(serve), "run", str(config)], cwd=repo, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    health = answer = None
    try:
        while time.perf_counter() - start < timeout and answer is None:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {proc.returncode}")
            if health is None and healthy(f"{base}/health"):
                health = time.perf_counter() - start
            reply = post(f"{base}/v1/chat/completions", CHAT, timeout=60)
            if reply and "choices" in reply:
                answer = (time.perf_counter() - start, reply["choices"][0]["message"]["content"])
            else:
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)
    if answer is None:
        raise RuntimeError(f"no answer within {timeout} s")
    return health if health is not None else answer[0], answer[0], answer[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose code and deploy/config.yaml run")
    parser.add_argument("--runs", type=int, default=2, help="starts on one cache directory, the first on an empty one")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--floor", choices=("bare", "imports"),
                        help="time benchmarks/serve_floor_app.py (no model) instead of deploy/config.yaml")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "xla"
        if args.floor:
            config = floor_config(Path(tmp), args.port, args.floor == "imports")
        else:
            config = config_with_cache(args.repo.resolve(), cache, args.port)
        print(f"| run | compilation cache | /health 200 s | first chat answer s | answer |  ({args.repo})")
        print("|---|---|---|---|---|")
        for run in range(args.runs):
            state = "none (no model)" if args.floor else "empty" if run == 0 else "from the runs before"
            health, first, text = one_start(args.repo.resolve(), config, args.port, args.timeout)
            print(f"| {run + 1} | {state} | {health:.1f} | {first:.1f} | {text!r} |", flush=True)


if __name__ == "__main__":
    main()
