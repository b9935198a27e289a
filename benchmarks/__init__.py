"""Benchmarks of sglang_ext policies against vanilla SGLang, measured in the same run.

    python -m benchmarks.decode_step --shape qwen1.5b --policies vanilla,full
    python -m benchmarks.e2e --shape qwen1.5b --policies vanilla,full
"""
