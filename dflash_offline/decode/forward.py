"""A transformers decoder LM run over slot-cache rows, with its own modules and weights.

Legend: N rows, S tokens per row, H hidden, F = len(capture) · H, M rows whose logits are wanted, V vocab.

The model's forward is not called: it would build transformers' causal mask from a cache it does not
know. The backbone's pieces are called in its order instead (embedding, rotary embedding, each decoder
layer with our mask and ``SlotCache``, final norm, LM head): every weight and every line of modelling
code stays the model's own (Llama-family and Qwen3 alike). The decoder layers' cache keyword is
``past_key_values`` in transformers 5.17 and ``cache`` in 5.24; it is read from their signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dflash_offline.decode.attention import LIVE_KEYS_KWARG, attention_configs, slot_attention_enabled
from dflash_offline.decode.slot_cache import ForwardRows, SlotCache
from dflash_offline.errors import TargetError
from dflash_offline.target_model.capture import backbone_of


class SlotForward:
    """Forwards of ``model`` (an HF CausalLM) whose attention reads and writes ``cache``."""

    embed: Any
    rotary: Any
    norm: Any
    head: Any

    def __init__(self, model: Any, cache: SlotCache) -> None:
        backbone: Any = backbone_of(model)
        head: Any = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not hasattr(backbone, "rotary_emb"):
            raise TargetError(
                f"{type(model).__name__}: the decode engine needs a CausalLM with an LM head and a rotary "
                "embedding on its backbone (Llama-family and Qwen3 models)"
            )
        config = getattr(backbone, "config")  # noqa: B009
        self.model = model
        self.cache = cache
        self.embed = backbone.embed_tokens
        self.rotary = backbone.rotary_emb
        self.layers = list(backbone.layers)[: int(config.num_hidden_layers)]
        self.norm = backbone.norm
        self.head = head
        self.hidden_size = int(config.hidden_size)
        self._configs = attention_configs(model)
        params = inspect.signature(self.layers[0].forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def hidden(
        self,
        ids_NS: Tensor,
        positions_NS: Tensor,
        mask_N1SL: Tensor | None,
        rows: ForwardRows,
        *,
        capture: Sequence[int] = (),
    ) -> tuple[Tensor, Tensor | None]:
        """Pre-norm hidden states [N, S, H] of the last layer, and the residual stream after each layer in
        ``capture`` concatenated [N, S, F] (None without ``capture``). Writes the tokens' K/V at
        ``rows.write_NS`` of their slots. ``mask_N1SL`` None: causal over the rows' own tokens
        (``rows.own_keys_only``), or each row over its live keys (``rows.live_keys``)."""
        assert list(capture) == sorted(set(capture)), capture
        wanted = set(capture)
        captured: list[Tensor] = []
        self.cache.rows = rows
        live = {} if rows.live_keys is None else {LIVE_KEYS_KWARG: rows.live_keys}
        try:
            with slot_attention_enabled(self._configs):
                h = self.embed(ids_NS)
                position_embeddings = self.rotary(h, positions_NS)
                for i, layer in enumerate(self.layers):
                    out = layer(
                        h,
                        attention_mask=mask_N1SL,
                        position_ids=positions_NS,
                        position_embeddings=position_embeddings,
                        use_cache=True,
                        **{self._cache_kwarg: self.cache},
                        **live,
                    )
                    h = out if isinstance(out, Tensor) else out[0]
                    if i in wanted:
                        captured.append(h)
        finally:
            self.cache.rows = None
        features = torch.cat(captured, dim=-1) if captured else None
        return h, features

    def logits(self, hidden_MH: Tensor) -> Tensor:
        """[M, V] logits of pre-norm hidden states (in the head's dtype)."""
        return self.head(self.norm(hidden_MH))  # type: ignore[no-any-return]
