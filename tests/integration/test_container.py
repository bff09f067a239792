"""The container recipe and the KubeRay manifest, checked without a Docker daemon or a cluster: what
the Dockerfile copies exists, its health check asks /health where the served config listens, the
installed package carries the cpu kernels' source, and the RayService's Serve config passes Ray's
schema and this app's config."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.config import AppConfig

ROOT = Path(__file__).parents[2]


def instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(maxsplit=1)) for line in lines]


def test_the_dockerfile_copies_what_exists_and_serves_the_default_config():
    steps = instructions()
    copies = [args.split()[:-1] for op, args in steps if op == "COPY"]
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    cmd = next(args for op, args in steps if op == "CMD")
    assert cmd == '["serve", "run", "deploy/config.yaml"]'
    port = yaml.safe_load((ROOT / "deploy/config.yaml").read_text())["http_options"]["port"]
    health = next(args for op, args in steps if op == "HEALTHCHECK")
    assert f"curl -fsS http://127.0.0.1:{port}/health" in health
    assert f"EXPOSE {port}" in " ".join(f"{op} {args}" for op, args in steps)
    assert any(op == "RUN" and "pip install --no-cache-dir . ${JAX_EXTRA}" in args for op, args in steps)


def test_the_tpu_build_arg_in_the_recipe_pins_the_projects_jax():
    jax = importlib.metadata.version("jax")
    assert f"JAX_EXTRA='jax[tpu]=={jax}'" in (ROOT / "Dockerfile").read_text()
    assert f"JAX_EXTRA='jax[tpu]=={jax}'" in (ROOT / "deploy/kuberay/rayservice.yaml").read_text()


def test_the_installed_package_carries_the_cpu_kernels_source(tmp_path):
    """What `pip install .` (the image's install) puts in site-packages: a wheel of what the
    Dockerfile copies, built in a copy (setuptools writes build/ beside the sources)."""
    source = tmp_path / "src"
    source.mkdir()
    for op, args in instructions():
        for name in args.split()[:-1] if op == "COPY" else []:
            copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
            copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("jax_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "engine/backends/cpu/kernels.cc" in names
    assert "serve_app/app.py" in names and "engine/generate/engine.py" in names


def test_the_rayservice_serves_a_valid_app_on_the_tpu_host_it_asks_for():
    service = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    model = AppConfig.from_args(app["args"]).models[0]
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == importlib.metadata.version("ray")
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["google.com/tpu"]) == model.resources["TPU"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == container["image"]
    assert {"containerPort": serve_config["http_options"]["port"], "name": "serve"} in head["ports"]


def test_the_image_installs_the_git_that_levanter_imports_need(tmp_path):
    """levanter imports GitPython at import time, which raises ImportError when no git executable is
    on the PATH: the text engine would never start in an image without it."""
    installs = " ".join(args for op, args in instructions() if op == "RUN" and "apt-get install" in args)
    assert "git" in re.findall(r"[\w.+-]+", installs.split("apt-get install", 1)[1].split("&&")[0])
    no_git = subprocess.run([sys.executable, "-c", "import levanter.models.llama"], capture_output=True, text=True,
                            env={"PATH": "/nonexistent", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})
    assert no_git.returncode != 0 and "ImportError: Bad git executable." in no_git.stderr
