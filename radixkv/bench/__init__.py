"""Benchmark scripts: ``python -m radixkv.bench NAME``. Never collected as tests."""
