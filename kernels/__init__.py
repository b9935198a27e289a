"""Triton kernels, each beside its torch reference (filled by the policy issues)."""
