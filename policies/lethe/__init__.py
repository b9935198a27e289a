"""Lethe: eviction during decoding. ``policy`` holds its parameters and round rules, ``runtime`` its
life in the engine (per-layer retained lists, rounds, freed slots back to SGLang's pool),
``layer_memory`` the per-layer memory packing."""

from sglang_ext.policies.lethe.policy import LayerShrink, Lethe

__all__ = ["LayerShrink", "Lethe"]
