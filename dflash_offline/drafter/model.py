"""The DFlash drafter: training forward over a packed row, and greedy block drafting for eval.

Legend: T tokens of the packed row, F = n·H feature width, A anchors, B block size, Q = A·B block
rows, C context tokens, H hidden, D head dim, Hk key/value heads, V vocabulary, K = B−1 draft positions.

Architecture (docs/drafter.md#architecture): ``ctx = hidden_norm(fc(features))`` once; L_d Qwen3-style
layers whose queries are the block rows and whose keys/values are [ctx ; block] (see layers.py); RoPE at
absolute positions (context p at its position in the document, block rows at a..a+B−1); final RMSNorm; the
target's frozen LM head. The block input is [x[a], MASK × (B−1)] through the target's frozen embedding.

The frozen embedding and LM head are non-persistent buffers: they move with ``.to()`` but are not in
``state_dict()`` (hence not exported or checkpointed), not parameters (no optimizer state), and listed
in ``_ddp_params_and_buffers_to_ignore`` so DDP neither broadcasts nor reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_offline.drafter.attention import (
    FLEX_BLOCK,
    AttentionBackend,
    FlexFallback,
    TrainingAttention,
    build_attention_index,
    resolve_backend,
)
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.layers import DecoderLayer, RMSNorm, rope_cos_sin
from dflash_offline.drafter.loss import block_labels, decay_weights, linear_argmax, linear_cross_entropy
from dflash_offline.errors import ConfigError, DataError


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterOutput:
    """Result of one training forward (one packed row)."""

    loss: Tensor
    """float32 scalar: Σ w_k·m·CE / Σ w_k·m (0 when nothing carries loss); differentiable."""
    weighted_ce_sum: Tensor
    """float32 scalar: Σ w_k·m·CE, differentiable (for normalising over microbatches or ranks)."""
    weight_sum: Tensor
    """float32 scalar: Σ w_k·m."""
    correct_K: Tensor
    """int64 [B−1]: correct greedy predictions at block position k = 1..B−1."""
    total_K: Tensor
    """int64 [B−1]: positions carrying loss at block position k = 1..B−1."""
    accepted_prefix_sum: Tensor
    """int64 scalar: Σ over blocks of the run of leading positions that carry loss and are correct."""
    num_blocks: int
    """A: blocks (anchors) in the row."""
    num_loss_tokens: Tensor
    """int64 scalar: positions carrying loss (Σ total_K)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSteps:
    """One decoder layer in three calls around its attention (``DecoderLayer.forward`` is
    ``finish(x, attend(*attention_inputs(x, …, *keys_values(ctx, …))))``): the training forward and eval's
    static drafter (``decode/drafting.py``) run a layer through them, eager or compiled alike."""

    keys_values: Callable[..., tuple[Tensor, Tensor]]
    """``DFlashAttention.keys_values``: the context rows' rotated, normed keys and their values."""
    attention_inputs: Callable[..., tuple[Tensor, Tensor, Tensor]]
    """``DecoderLayer.attention_inputs``: q and [context ; block] k, v for the attend function."""
    finish: Callable[..., Tensor]
    """``DecoderLayer.finish``: the layer's output from its input and the attention's."""


class ContextCache:
    """Per-layer keys/values of the context seen so far by ``draft`` (positions 0..length−1)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        """Per layer: rotated, normed keys [Hk, C, D]."""
        self.values: list[Tensor | None] = [None] * num_layers
        """Per layer: values [Hk, C, D]."""
        self.length = 0
        """C: context positions held."""


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter over a frozen target embedding and LM head."""

    embed_VH: Tensor
    _lm_head_VH: Tensor | None
    feature_scale_F: Tensor | None

    def __init__(self, config: DrafterConfig, *, embed_VH: Tensor, lm_head_VH: Tensor) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.fc = nn.Linear(config.feature_width, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.register_buffer("embed_VH", torch.empty(0), persistent=False)
        self.register_buffer("_lm_head_VH", None, persistent=False)
        # Optional fixed per-feature multiplier applied before fc (training only: the export folds it
        # into fc.weight). Persistent, so that checkpoints carry it; absent from state_dict while None.
        self.register_buffer("feature_scale_F", None)
        self._ddp_params_and_buffers_to_ignore = ["embed_VH", "_lm_head_VH", "feature_scale_F"]
        self.flex_fallback = FlexFallback()
        """Whether this model's compiled flex_attention failed (it then uses SDPA, having warned)."""
        self._compiled_steps: list[LayerSteps] | None = None
        """The compiled per-layer training steps (``compile_training``), or None: eager."""
        self._cast_head: tuple[Any, Tensor] | None = None
        """(what it was cast from, the LM head in the autocast dtype): see ``_head_in``."""
        self.load_frozen_head(embed_VH, lm_head_VH)
        self.reset_parameters()

    # ----- weights -------------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """Qwen3 initialisation: linear weights ~ N(0, initializer_range), norm weights 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_feature_scale(self, scale_F: Tensor | None) -> None:
        """Install (or with None remove) the fixed float32 feature multiplier [F] applied before fc."""
        if scale_F is None:
            self.feature_scale_F = None
            return
        if tuple(scale_F.shape) != (self.config.feature_width,) or not bool(torch.isfinite(scale_F).all()):
            raise ConfigError(
                f"feature scale of shape {tuple(scale_F.shape)}: must be finite, "
                f"[{self.config.feature_width}]"
            )
        self.feature_scale_F = scale_F.detach().to(self.fc.weight.device, torch.float32)

    def folded_fc_weight(self) -> Tensor:
        """fc.weight with the feature scale folded in (fc(x·s) = (W·diag(s)) x), in fc's dtype."""
        w = self.fc.weight.detach()
        if self.feature_scale_F is None:
            return w
        return (w.float() * self.feature_scale_F[None, :]).to(w.dtype)

    def load_frozen_head(self, embed_VH: Tensor, lm_head_VH: Tensor) -> None:
        """Install the target's embedding and LM head [V, H] (frozen; a tied head is stored once)."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, t in (("embedding", embed_VH), ("lm_head", lm_head_VH)):
            if tuple(t.shape) != want:
                raise ConfigError(
                    f"target {name} has shape {tuple(t.shape)}, the drafter config expects {want} "
                    "(vocab_size, hidden_size): build the config from the same target"
                )
        tied = lm_head_VH is embed_VH or (
            lm_head_VH.data_ptr() == embed_VH.data_ptr() and lm_head_VH.stride() == embed_VH.stride()
        )
        self.embed_VH = embed_VH.detach().requires_grad_(False)
        self._lm_head_VH = None if tied else lm_head_VH.detach().requires_grad_(False)

    def _head_in(self, dtype: torch.dtype) -> Tensor:
        """The frozen LM head in ``dtype``, cast once and kept (it never changes): a float32 head of
        Qwen3-8B's size is 2.5 GB, and casting it every microbatch cost a 1.2 GB allocation each time."""
        head = self.lm_head_VH
        if head.dtype == dtype:
            return head
        key = (dtype, head.device, head.data_ptr(), head.shape)
        if self._cast_head is None or self._cast_head[0] != key:
            self._cast_head = (key, head.detach().to(dtype))
        return self._cast_head[1]

    @property
    def lm_head_VH(self) -> Tensor:
        """The frozen LM head [V, H] (the embedding itself when the target ties them)."""
        return self.embed_VH if self._lm_head_VH is None else self._lm_head_VH

    def decoder_layers(self) -> list[DecoderLayer]:
        """The L_d decoder layers, typed."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def cast_parameters(self, dtype: torch.dtype) -> DFlashDrafter:
        """Cast the trainable weights only (``.to(dtype)`` would also cast the frozen head buffers)."""
        for p in self.parameters():
            p.data = p.data.to(dtype)
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter the optimizer updates (all of them: the frozen tensors are buffers)."""
        return [p for p in self.parameters() if p.requires_grad]

    # ----- shared pieces -------------------------------------------------------------------------

    def _param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features_CF: Tensor) -> Tensor:
        """ctx [C, H] = hidden_norm(fc(features)); under autocast fc takes the bf16 features as they are."""
        if features_CF.shape[-1] != self.config.feature_width:
            raise DataError(
                f"features are {features_CF.shape[-1]} wide; this drafter expects "
                f"{self.config.feature_width} = {self.config.num_features} layers × {self.config.hidden_size}"
            )
        if self.feature_scale_F is not None:
            # In float32 (the product rounds once, in fc's input cast).
            features_CF = features_CF.float() * self.feature_scale_F
        if not torch.is_autocast_enabled(features_CF.device.type):
            features_CF = features_CF.to(self._param_dtype())
        return self.hidden_norm(self.fc(features_CF))

    def embed_ids(self, ids: Tensor) -> Tensor:
        """Frozen embedding rows of ``ids``, in the parameter dtype."""
        return F.embedding(ids, self.embed_VH).to(self._param_dtype())

    def block_input_ids(self, inputs: DrafterInputs) -> Tensor:
        """int64 [A, B]: [x[a], MASK × (B−1)] per anchor."""
        A, B = inputs.num_anchors, self.config.block_size
        ids = torch.full((A, B), self.config.mask_token_id, dtype=torch.int64, device=inputs.anchors_A.device)
        ids[:, 0] = inputs.input_ids_T[inputs.anchors_A]
        return ids

    def embed_blocks(self, inputs: DrafterInputs) -> Tensor:
        """Block input embeddings [Q, H] (frozen embedding rows, in the parameter dtype)."""
        return self.embed_ids(self.block_input_ids(inputs).reshape(-1))

    # ----- training ------------------------------------------------------------------------------

    def forward_hidden(
        self,
        inputs: DrafterInputs,
        *,
        attention: AttentionBackend = "auto",
        block_embeds_QH: Tensor | None = None,
        checkpoint_layers: bool = False,
    ) -> Tensor:
        """Final-normed hidden states [Q, H] of every block row (block j = rows j·B..j·B+B−1)."""
        cfg = self.config
        inputs.validate(feature_width=cfg.feature_width)
        B, D = cfg.block_size, cfg.head_dim
        if block_embeds_QH is None:
            block_embeds_QH = self.embed_blocks(inputs)
        requires_grad = torch.is_grad_enabled() and (
            block_embeds_QH.requires_grad
            or inputs.features_TF.requires_grad
            or any(p.requires_grad for p in self.parameters())
        )
        device = block_embeds_QH.device
        backend = resolve_backend(
            attention, device, requires_grad=requires_grad, flex_failed=self.flex_fallback.failed
        )
        index = build_attention_index(
            inputs.doc_ids_T,
            inputs.positions_T,
            inputs.anchors_A,
            block_size=B,
            pad_to=FLEX_BLOCK if backend == "flex" else 1,
        )
        attend = TrainingAttention(index, "flex" if backend == "flex" else "sdpa", self.flex_fallback)
        ctx_TH = self.context(inputs.features_TF)
        ctx_cos, ctx_sin = rope_cos_sin(inputs.positions_T, D, cfg.rope_theta)
        block_pos_Q = (
            inputs.positions_T[inputs.anchors_A].to(torch.int64)[:, None]
            + torch.arange(B, device=device)[None, :]
        ).reshape(-1)
        q_cos, q_sin = rope_cos_sin(block_pos_Q, D, cfg.rope_theta)

        steps = self._compiled_steps or self.layer_steps()

        def run_layer(i: int, x_QH: Tensor, ctx: Tensor) -> Tensor:
            step = steps[i]
            k, v = step.keys_values(ctx, ctx_cos, ctx_sin)
            return step.finish(x_QH, attend(*step.attention_inputs(x_QH, q_cos, q_sin, k, v)))

        x = block_embeds_QH
        for i in range(len(steps)):
            if checkpoint_layers and requires_grad:
                x = checkpoint(run_layer, i, x, ctx_TH, use_reentrant=False)  # type: ignore[assignment]
            else:
                x = run_layer(i, x, ctx_TH)
        return self.norm(x)  # type: ignore[no-any-return]

    def layer_steps(self, *, compile_backend: str | None = None) -> list[LayerSteps]:
        """Per layer: its three calls around attention, the layers' own methods, or with ``compile_backend``
        each ``torch.compile``d for every shape at once (``dynamic=True``: rows, anchors and context
        lengths differ from call to call). Compiled, the norms, projections, RoPE and the MLP run as a few
        fused kernels instead of many small ones; attention itself stays outside (flex's own compiled
        kernel, or SDPA). Fused kernels round differently from eager ones: numbers close to, not equal to,
        eager's."""
        layers = self.decoder_layers()
        if compile_backend is None:
            return [
                LayerSteps(
                    keys_values=layer.self_attn.keys_values,
                    attention_inputs=layer.attention_inputs,
                    finish=layer.finish,
                )
                for layer in layers
            ]
        return [
            LayerSteps(
                keys_values=torch.compile(layer.self_attn.keys_values, dynamic=True, backend=compile_backend),
                attention_inputs=torch.compile(layer.attention_inputs, dynamic=True, backend=compile_backend),
                finish=torch.compile(layer.finish, dynamic=True, backend=compile_backend),
            )
            for layer in layers
        ]

    def compile_training(self, *, backend: str = "inductor") -> None:
        """The training forward through compiled layer steps from now on (``layer_steps``); ``draft`` is
        not affected."""
        self._compiled_steps = self.layer_steps(compile_backend=backend)

    def forward_train(
        self,
        inputs: DrafterInputs,
        *,
        attention: AttentionBackend = "auto",
        loss_chunk_rows: int = 1024,
        checkpoint_layers: bool = False,
    ) -> DrafterOutput:
        """Decayed cross-entropy and accuracy counts of one packed row (docs/drafter.md#labels-and-loss).

        The LM head runs only over the rows that carry loss, ``loss_chunk_rows`` at a time, so the
        [A·B, V] logits never exist at once (see loss.linear_cross_entropy).
        """
        cfg = self.config
        B = cfg.block_size
        dev = inputs.anchors_A.device
        if inputs.num_anchors == 0:
            return self._output_without_blocks(dev)
        labels = block_labels(inputs.input_ids_T, inputs.loss_mask_T, inputs.doc_ids_T, inputs.anchors_A, B)
        hidden_QH = self.forward_hidden(inputs, attention=attention, checkpoint_layers=checkpoint_layers)
        w_AB = decay_weights(B, cfg.gamma, device=dev)[None, :] * labels.valid_AB.float()
        rows = inputs.loss_rows_N
        if rows is None:  # a host sync on a GPU (the row count is data-dependent): see loss.loss_rows
            rows = torch.nonzero(labels.valid_AB.reshape(-1)).flatten()
        label_rows = labels.label_ids_AB.reshape(-1)[rows]
        head_VH = self.lm_head_VH
        if torch.is_autocast_enabled(dev.type):
            # The LM head matmul is the largest of the step: run it in the autocast dtype too.
            head_VH = self._head_in(torch.get_autocast_dtype(dev.type))
        ce_sum, preds = linear_cross_entropy(
            hidden_QH[rows], head_VH, label_rows, w_AB.reshape(-1)[rows], chunk_rows=loss_chunk_rows
        )
        weight_sum = w_AB.sum()
        loss = torch.where(weight_sum > 0, ce_sum / weight_sum.clamp_min(1e-30), ce_sum * 0.0)
        with torch.no_grad():
            correct_AB = torch.zeros_like(labels.valid_AB)
            correct_AB.view(-1)[rows] = preds == label_rows
            total_K = labels.valid_AB[:, 1:].sum(0)
            prefix = torch.cumprod(correct_AB[:, 1:].to(torch.int64), dim=1).sum()
        return DrafterOutput(
            loss=loss,
            weighted_ce_sum=ce_sum,
            weight_sum=weight_sum,
            correct_K=correct_AB[:, 1:].sum(0),
            total_K=total_K,
            accepted_prefix_sum=prefix,
            num_blocks=inputs.num_anchors,
            num_loss_tokens=total_K.sum(),
        )

    @torch.no_grad()
    def block_runs(
        self, inputs: DrafterInputs, *, attention: AttentionBackend = "auto", chunk_rows: int = 1024
    ) -> Tensor:
        """int64 [A]: the leading run of correct positions (0..B−1) of each block of ``inputs`` under the
        training forward: the drafts a speculative decoder accepts at that anchor when the context is the
        row's own tokens. Predicted as ``forward_train`` predicts (the LM head ``chunk_rows`` rows at a
        time, in the autocast dtype under autocast), so the mean over a draw of anchors is its per-block
        τ − 1; a position past the anchor's document or loss mask counts as wrong.

        The LM head, the largest product here, runs position by position over the blocks still correct
        so far: Σ (run + 1) rows instead of A·(B−1). Each position waits for the device once."""
        B = self.config.block_size
        dev = inputs.anchors_A.device
        runs_A = torch.zeros(inputs.num_anchors, dtype=torch.int64, device=dev)
        if inputs.num_anchors == 0:
            return runs_A
        hidden_ABH = self.forward_hidden(inputs, attention=attention).view(inputs.num_anchors, B, -1)
        head_VH = self.lm_head_VH
        if torch.is_autocast_enabled(dev.type):
            head_VH = self._head_in(torch.get_autocast_dtype(dev.type))
        labels = block_labels(inputs.input_ids_T, inputs.loss_mask_T, inputs.doc_ids_T, inputs.anchors_A, B)
        running = torch.nonzero(labels.valid_AB[:, 1]).flatten()  # blocks whose run may reach position 1
        for k in range(1, B):
            if running.numel() == 0:
                break
            proposals = linear_argmax(hidden_ABH[running, k], head_VH, chunk_rows=chunk_rows)
            hit = (proposals == labels.label_ids_AB[running, k]) & labels.valid_AB[running, k]
            running = running[hit]
            runs_A[running] += 1
        return runs_A

    def _output_without_blocks(self, dev: torch.device) -> DrafterOutput:
        """The output of a row without anchors: zeros, with a gradient path to every parameter (DDP's
        reducer must see a gradient for each of them)."""
        K = self.config.block_size - 1
        zero = sum((p.sum() * 0.0 for p in self.trainable_parameters()), torch.zeros((), device=dev))
        zi = torch.zeros((), dtype=torch.int64, device=dev)
        return DrafterOutput(
            loss=zero.float(),
            weighted_ce_sum=zero.float(),
            weight_sum=torch.zeros((), device=dev),
            correct_K=torch.zeros(K, dtype=torch.int64, device=dev),
            total_K=torch.zeros(K, dtype=torch.int64, device=dev),
            accepted_prefix_sum=zi,
            num_blocks=0,
            num_loss_tokens=zi,
        )

    def forward(self, inputs: DrafterInputs, **kwargs: object) -> DrafterOutput:  # type: ignore[override]
        """``forward_train``, so that a DDP wrapper's ``__call__`` reaches it."""
        return self.forward_train(inputs, **kwargs)  # type: ignore[arg-type]

    # ----- inference -----------------------------------------------------------------------------

    def new_context_cache(self) -> ContextCache:
        """An empty per-layer context K/V cache for ``draft``."""
        return ContextCache(len(self.layers))

    @torch.no_grad()
    def draft_hidden(
        self,
        *,
        context_features_CF: Tensor,
        anchor_token: int,
        anchor_position: int,
        cache: ContextCache | None = None,
    ) -> Tensor:
        """Final-normed hidden [B, H] of the block [anchor_token, MASK × (B−1)] at anchor_position.

        Without ``cache`` the features are those of positions anchor_position−C .. anchor_position−1.
        With ``cache`` they are the *new* positions cache.length .. anchor_position−1, appended to it.
        """
        cfg = self.config
        B, D = cfg.block_size, cfg.head_dim
        C = int(context_features_CF.shape[0])
        start = cache.length if cache is not None else anchor_position - C
        if start < 0 or start + C != anchor_position:
            raise DataError(
                f"context covers positions {start}..{start + C - 1} but the anchor is at {anchor_position}: "
                "pass the features of every position before the anchor (only the new ones with a cache)"
            )
        dev = self.fc.weight.device
        ctx = self.context(context_features_CF.to(dev))
        ctx_cos, ctx_sin = rope_cos_sin(torch.arange(start, anchor_position, device=dev), D, cfg.rope_theta)
        ids = torch.full((B,), cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[0] = anchor_token
        x = self.embed_ids(ids)
        q_cos, q_sin = rope_cos_sin(
            torch.arange(anchor_position, anchor_position + B, device=dev), D, cfg.rope_theta
        )

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # Every query sees the whole context before the anchor and its whole block: no mask.
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

        for i, layer in enumerate(self.decoder_layers()):
            k, v = layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)
            if cache is not None:
                old_k, old_v = cache.keys[i], cache.values[i]
                if old_k is not None and old_v is not None:
                    k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
                cache.keys[i], cache.values[i] = k, v
            x = layer(x, q_cos, q_sin, k, v, attend)
        if cache is not None:
            cache.length = anchor_position
        return self.norm(x)  # type: ignore[no-any-return]

    @torch.no_grad()
    def draft_logits(self, **kwargs: object) -> Tensor:
        """float32 logits [B−1, V] of the draft positions (arguments of ``draft_hidden``)."""
        hidden = self.draft_hidden(**kwargs)[1:]  # type: ignore[arg-type]
        return (hidden.to(self.lm_head_VH.dtype) @ self.lm_head_VH.T).float()

    @torch.no_grad()
    def draft(
        self,
        *,
        context_features_CF: Tensor,
        anchor_token: int,
        anchor_position: int,
        cache: ContextCache | None = None,
    ) -> Tensor:
        """Greedy proposal int64 [B−1] for positions anchor_position+1 .. anchor_position+B−1."""
        logits = self.draft_logits(
            context_features_CF=context_features_CF,
            anchor_token=anchor_token,
            anchor_position=anchor_position,
            cache=cache,
        )
        return logits.argmax(dim=-1)
