"""Import the heavy modules of ``dflash train``'s start-up on a thread while the index is read.

Before its first step a run imports transformers' config machinery (the drafter's shape comes from the
target's config; transformers 5 pulls ``torch.distributed.tensor`` in with it) and ``torch._dynamo``
(``torch.optim.AdamW`` imports it on construction): pure-Python imports that took ≈ 1.3 s of the
1M-sample start-up, all on the one thread, while the manifest read, the sort and the snapshot (Arrow and
numpy, which release the GIL) took ≈ 1 s more. Started first, the imports run beside them.

The caller joins the thread before it needs any of these modules itself, so that no module is ever
imported from two threads at once (a concurrent circular import would hand one of them a partly
initialised module). Best effort: a module that fails to import here is imported again, and fails
with its real error, where it is used.
"""

from __future__ import annotations

import importlib
import threading

WARM_MODULES = (
    "transformers.configuration_utils",
    "transformers.models.llama.configuration_llama",
    "transformers.models.qwen3.configuration_qwen3",
    "transformers.models.auto.configuration_auto",
    "torch._dynamo",
)


def _import_all() -> None:
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # best effort (see the module docstring)
            continue


def start_import_warmup() -> threading.Thread:
    """Start importing ``WARM_MODULES`` on a daemon thread; ``join()`` it before using them."""
    thread = threading.Thread(target=_import_all, name="dflash-import-warmup", daemon=True)
    thread.start()
    return thread
