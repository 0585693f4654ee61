"""One decode engine for ``dflash regenerate`` and both ``dflash eval`` loops.

The target's own transformers modules run over a KV cache of slots (``slot_cache``: preallocated per
layer, per-row lengths, GQA keys read in place by one SDPA call, ``attention``); ``forward`` drives the
model's layers over it (eager or compiled; ``layer_attention`` is how their attention modules reach the
cache), ``steps`` holds the decode step and the chunked prefill, ``graphs`` replays a step
as a CUDA graph, ``sampling`` picks tokens (greedy, or seeded per request), ``engine`` is continuous
batching for regenerate, and ``single`` the batch-1 target-only and speculative loops of eval (with
``drafting``: the drafter over a static context cache). ``parked`` keeps a finished request's slot for the
request that continues it (a conversation's next turn prefills only what its prompt adds).
"""

from dflash_offline.decode.engine import DecodedRequest, DecodeEngine, DecodeError, EngineSettings
from dflash_offline.decode.sampling import Sampling
from dflash_offline.decode.single import DecodeResult, SingleSequence

__all__ = [
    "DecodeEngine",
    "DecodeError",
    "DecodeResult",
    "DecodedRequest",
    "EngineSettings",
    "Sampling",
    "SingleSequence",
]
