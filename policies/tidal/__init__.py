"""TidalDecode: token-selection layers pick the top-k tokens, the other layers reuse them;
``cache_correction`` re-fills sparsely decoded tokens' K/V with full attention."""

from sglang_ext.policies.tidal.policy import TidalPolicy

__all__ = ["TidalPolicy"]
