"""What tests and benchmarks share: tiny random checkpoints (tiny_models), the transformers reference
(parity), the fake engine, local Hub and S3 servers, a virtual clock, serving helpers."""
