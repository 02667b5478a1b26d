"""Benchmarks of fully_shard against torch FSDP2, DDP and one unsharded process, plus a
scale simulation to 1024 ranks: ``python3 -m benchmarks [--quick]`` (docs/benchmarks.md)."""
