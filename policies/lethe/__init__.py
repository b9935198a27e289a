"""Lethe: eviction during decoding. ``policy`` holds its parameters and round rules (and
``EvictionPolicy``, what the runtime asks of any rule it runs), ``runtime`` its life in the engine
(per-layer retained lists, rounds, freed slots back to SGLang's pool), ``layer_memory`` the
per-layer memory packing, ``scorers`` the public decode-time scorers SnapKV, TOVA and H2O on the
same runtime."""

from sglang_ext.policies.lethe.policy import EvictionPolicy, LayerShrink, Lethe
from sglang_ext.policies.lethe.scorers import H2O, TOVA, DecodeScorer, SnapKV

__all__ = ["H2O", "TOVA", "DecodeScorer", "EvictionPolicy", "LayerShrink", "Lethe", "SnapKV"]
