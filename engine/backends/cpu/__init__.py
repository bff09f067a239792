"""The `cpu` backend (backend.py) and everything it owns: the x86 kernels (kernels.cc, loaded and
called from kernels.py), the packed and fused weights they read, and the per-shape choice between a
kernel and XLA's dot (matmul_choice.py)."""
