"""One decode engine for ``dflash regenerate`` and ``dflash eval``.

The target's own transformers modules run over a KV cache of slots (``slot_cache``: preallocated per
layer, per-row lengths, GQA keys read in place by one SDPA call, ``attention``); ``forward`` drives the
model's layers over it (eager or compiled; ``layer_attention`` is how their attention modules reach the
cache), ``steps`` holds the decode step and the chunked prefill, ``graphs`` replays a step
as a CUDA graph, ``sampling`` picks tokens (greedy, or seeded per request), ``engine`` is continuous
batching for regenerate, and ``speculative`` the one batch-1 loop of eval, a draft–verify cycle at a time
(target-only decoding is that loop with a drafter that proposes nothing; ``drafting``: the drafter over a
static context cache). ``parked`` keeps a finished request's slot for the
request that continues it (a conversation's next turn prefills only what its prompt adds).
"""

from dflash_offline.decode.engine import DecodedRequest, DecodeEngine, DecodeError, EngineSettings
from dflash_offline.decode.sampling import Sampling
from dflash_offline.decode.speculative import TARGET_ONLY, DecodeResult, Drafter, SingleSequence

__all__ = [
    "TARGET_ONLY",
    "DecodeEngine",
    "DecodeError",
    "DecodeResult",
    "DecodedRequest",
    "Drafter",
    "EngineSettings",
    "Sampling",
    "SingleSequence",
]
