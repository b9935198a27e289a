"""sglang_ext: KV-cache policies that run inside the SGLang serving engine."""

__version__ = "0.1.0"
