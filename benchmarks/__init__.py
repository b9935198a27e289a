"""Benchmarks of sglang_ext policies against vanilla SGLang measured in the same run (README.md)."""
