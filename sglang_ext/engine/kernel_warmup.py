"""Kernels a scheduler needs later, built while the server starts.

FlashInfer ships its sampling kernels as source and compiles them on first use: in the first
step that samples with top-k/top-p (a chat request under the model's default top_p, say).
On a host without FlashInfer's compiled cache that step waits for nvcc, and the scheduler answers
nothing meanwhile (a stream gets its 200 and no token while /health fails). Built here, in every
scheduler before the server says it is ready, the compile costs start-up time once per host
instead.
"""

from __future__ import annotations

import logging
import time

from sglang_ext.engine.targets import EngineAdapterError

logger = logging.getLogger(__name__)

SAMPLING_MODULE = "flashinfer.sampling.get_sampling_module"  # what SGLang's sampler calls into


def build_sampling_kernels(sampling_backend: str) -> None:
    """Build (or load from FlashInfer's cache) the kernels SGLang's ``flashinfer`` sampling backend
    runs; nothing for another backend. Two processes building at once share FlashInfer's lock."""
    if sampling_backend != "flashinfer":
        return
    import pkgutil

    try:
        get_sampling_module = pkgutil.resolve_name(SAMPLING_MODULE)
    except (ImportError, AttributeError) as err:
        raise EngineAdapterError(
            f"--sampling-backend flashinfer: {SAMPLING_MODULE} is missing ({err}); sglang_ext "
            "builds FlashInfer's sampling kernels at start-up"
        ) from err
    start = time.perf_counter()
    get_sampling_module()
    seconds = time.perf_counter() - start
    if seconds > 1.0:  # a compile, not a load from the cache
        logger.info("sglang_ext: built FlashInfer's sampling kernels in %.0f s", seconds)
