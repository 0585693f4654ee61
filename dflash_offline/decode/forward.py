"""A transformers decoder LM run over slot-cache rows, with its own modules and weights.

Legend: N rows, S tokens per row, H hidden, F = len(capture) · H, M rows whose logits are wanted, V vocab.

The model's forward is not called: it would build transformers' causal mask from a cache it does not
know. The backbone's pieces are called in its order instead (embedding, rotary embedding, each decoder
layer with our mask and no transformers cache, final norm, LM head): every weight and every line of
modelling code stays the model's own (Llama-family and Qwen3 alike). Each layer's attention module hands
its new keys and values to ``layer_attention.slot_attention``, which writes them into the ``SlotCache``
and attends over it.

With ``compile_backend`` (``--compile``) each decoder layer runs through ``torch.compile``: inductor
fuses its many small elementwise kernels (RMSNorm alone is six a call); the attention stays one opaque
operator (``layer_attention``). A batch-1 step is launch-bound, and there it pays (an H200: 0.56× a
step's time); in regenerate it measured slower (0.33×), so only eval compiles by default. Any failure
of a compiled layer, at its first compile or later, switches the forward to eager for good with a
``TargetCompileWarning`` (the answers the same, slower).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dflash_offline.decode.layer_attention import attention_configs, slot_attention_enabled
from dflash_offline.decode.slot_cache import ForwardRows, SlotCache
from dflash_offline.errors import TargetError
from dflash_offline.target_model.capture import backbone_of

DEFAULT_COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for ``--compile on`` (regenerate and eval)."""

RECOMPILE_LIMIT = 64
"""Compiled graphs kept per code object: one compile serves every layer, but guards split it by kind
(decode step, fresh prefill, continuation; one row or many), more than dynamo's default of 8."""


class TargetCompileWarning(RuntimeWarning):
    """``torch.compile`` of the target's decoder layers failed; they run eagerly (slower, the answers the
    same)."""


def compile_layers(layers: Sequence[Any], backend: str) -> list[Any]:
    """The decoder layers through ``torch.compile`` (shared compiled graphs: the layer index is a dynamic
    integer, and every shape is dynamic, so that buckets and row counts do not recompile). The two dynamo
    settings are process-wide: they hold for the drafter's compile in the same process too."""
    import torch._dynamo

    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return [torch.compile(layer, backend=backend, dynamic=True) for layer in layers]


class SlotForward:
    """Forwards of ``model`` (an HF CausalLM) whose attention reads and writes ``cache``."""

    embed: Any
    rotary: Any
    norm: Any
    head: Any

    def __init__(self, model: Any, cache: SlotCache, *, compile_backend: str | None = None) -> None:
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
        self._compiled_layers: list[Any] | None = None
        if compile_backend is not None:
            try:
                self._compiled_layers = compile_layers(self.layers, compile_backend)
            except Exception as exc:  # a torch without these settings: eager, with the warning
                self._fall_back_to_eager(exc)

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers run compiled (asked for, and no compiled forward has failed)."""
        return self._compiled_layers is not None

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
        self.cache.rows = rows
        try:
            with slot_attention_enabled(self._configs, self.cache):
                if self._compiled_layers is not None:
                    try:
                        return self._layers(self._compiled_layers, ids_NS, positions_NS, mask_N1SL, capture)
                    except Exception as exc:  # a compiler or Triton failure must not end the run
                        self._fall_back_to_eager(exc)
                # Eager (again, after a failure: every write it repeats puts the same keys in place).
                return self._layers(self.layers, ids_NS, positions_NS, mask_N1SL, capture)
        finally:
            self.cache.rows = None

    def _fall_back_to_eager(self, exc: Exception) -> None:
        self._compiled_layers = None
        why = " ".join(str(exc).split())[:300]
        warnings.warn(
            TargetCompileWarning(
                f"torch.compile of the target's layers failed ({type(exc).__name__}: {why}); they run "
                "eagerly from now on (the answers the same)"
            ),
            stacklevel=4,
        )

    def _layers(
        self,
        layers: Sequence[Any],
        ids_NS: Tensor,
        positions_NS: Tensor,
        mask_N1SL: Tensor | None,
        capture: Sequence[int],
    ) -> tuple[Tensor, Tensor | None]:
        wanted = set(capture)
        captured: list[Tensor] = []
        h = self.embed(ids_NS)
        position_embeddings = self.rotary(h, positions_NS)
        for i, layer in enumerate(layers):
            out = layer(
                h,
                attention_mask=mask_N1SL,
                position_ids=positions_NS,
                position_embeddings=position_embeddings,
            )
            h = out if isinstance(out, Tensor) else out[0]
            if i in wanted:
                captured.append(h)
        features = torch.cat(captured, dim=-1) if captured else None
        return h, features

    def logits(self, hidden_MH: Tensor) -> Tensor:
        """[M, V] logits of pre-norm hidden states (in the head's dtype)."""
        return self.head(self.norm(hidden_MH))  # type: ignore[no-any-return]
