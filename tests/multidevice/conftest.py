"""Tests that need several devices: tests/integration/test_tensor_parallel.py runs this folder in its own
pytest process with 4 host CPU devices (XLA_FLAGS must be set before jax starts), so the rest of
the suite keeps one device. Run by hand with:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_SERVE_MULTIDEVICE=1 \
        .venv/bin/python -m pytest tests/multidevice
"""

from __future__ import annotations

import jax

NUM_DEVICES = 4

if len(jax.devices()) < NUM_DEVICES:
    raise RuntimeError(f"tests/multidevice needs {NUM_DEVICES} devices, this process has {len(jax.devices())}: "
                       f"set XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} (see this file)")
