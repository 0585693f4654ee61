"""dflash-offline: train DFlash speculative-decoding drafters from an offline hidden-state cache.

Data flows one way: data set → target → cache → planner → prefetcher → drafter.
Subpackages: ``data`` (chat data sets, templates, loss masks), ``target_model`` (loading and running the
target LLM), ``cache`` (sharded Zarr stores + Parquet manifest + DuckDB index), ``generate`` (phase 1),
``drafter`` (the DFlash model), ``train`` (phase 2), ``eval`` (speculative decoding), ``cli``.
"""

__version__ = "0.1.0"
