"""One optimizer step of one data-parallel rank, with no host sync: what it computes stays on the device
until someone reads it (``StepOutcome.read``, at a log step).

Loss normalisation: a step's loss is Σ w·CE / Σ w over every microbatch of every rank. The weight
sum of each microbatch is known before its forward (it depends only on anchors and labels), so the
step's total is all-reduced first and each microbatch backpropagates ``Σ w·CE / total × world``
(DDP averages over ranks). One process with grad_accum = 2 and two processes with grad_accum = 1
therefore compute the same gradient up to float summation order.

Host syncs a step used to make, and where they went: the loss weights' ``w[0] = 0.0`` (twice a
microbatch: ``drafter.loss.decay_weights`` is cached and built with ``torch.where``); ``torch.nonzero``
of the positions carrying loss (the prefetcher computes them on the host: ``DrafterInputs.loss_rows_N``);
three ``.tolist()`` of the metrics and ``float(grad_norm)`` (``StepOutcome`` keeps them on the device);
the stop flag's all-reduce under DDP (``train/loop.py`` agrees on it where it reads the metrics).

Shape legend: K = B − 1 block positions that carry loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_offline.drafter.anchors import sample_anchors
from dflash_offline.drafter.attention import AttentionBackend
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.loss import block_labels, decay_weights
from dflash_offline.placement import DistInfo
from dflash_offline.train.dist import all_reduce_sum
from dflash_offline.train.metrics import StepAccumulator, StepTotals
from dflash_offline.train.microbatch import AnchorRequest


def anchor_sampler(
    num_anchors: int, *, per_row: int | None = None
) -> Callable[[AnchorRequest], torch.Tensor]:
    """The prefetcher's anchor function: up to ``num_anchors`` block starts per document and ``per_row``
    (default ``num_anchors``) per microbatch row (a fused row of k microbatches: k × ``num_anchors``)."""

    def anchor_fn(request: AnchorRequest) -> torch.Tensor:
        return sample_anchors(
            request.loss_mask_T,
            request.doc_ids_T,
            num_anchors=num_anchors,
            generator=request.generator,
            max_total=per_row or num_anchors,
        )

    return anchor_fn


def loss_weight(inputs: DrafterInputs, config: DrafterConfig) -> torch.Tensor:
    """Σ w_k·m of one microbatch (float64 scalar on its device), computed before the forward."""
    if inputs.num_anchors == 0:
        return torch.zeros((), dtype=torch.float64, device=inputs.anchors_A.device)
    labels = block_labels(
        inputs.input_ids_T, inputs.loss_mask_T, inputs.doc_ids_T, inputs.anchors_A, config.block_size
    )
    w_B = decay_weights(config.block_size, config.gamma, device=inputs.anchors_A.device)
    return (labels.valid_AB.to(torch.float64) * w_B.double()[None, :]).sum()


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """What an optimizer step computed, still on the device (reading it is a host sync)."""

    stats_S: torch.Tensor
    """float64 [S]: the step's sums over every microbatch of every rank (``StepAccumulator.pack``)."""
    grad_norm: torch.Tensor
    """float32 scalar: the total gradient norm before clipping."""
    block_size: int

    def read(self) -> tuple[StepTotals, float]:
        """(totals, gradient norm before clipping): one device-to-host copy, a host sync."""
        return StepOutcome.read_all([self])[0]

    @staticmethod
    def read_all(outcomes: Sequence[StepOutcome]) -> list[tuple[StepTotals, float]]:
        """``read()`` of each of ``outcomes`` (steps since the last read-back) in one device-to-host copy."""
        packed = [torch.cat([o.grad_norm.detach().double().reshape(1), o.stats_S]) for o in outcomes]
        rows = torch.stack(packed).tolist()
        return [
            (StepAccumulator.totals(values[1:], o.block_size), float(values[0]))
            for o, values in zip(outcomes, rows, strict=True)
        ]


class OptimizerStep:
    """Forward and backward of a rank's microbatches, then clip and optimizer step at the learning rate
    the caller set in the param groups: nothing read back (see the module docstring). Shared by the
    training loop and bench/train_step.py."""

    def __init__(
        self,
        *,
        model: nn.Module,
        ddp_model: nn.Module,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        drafter_config: DrafterConfig,
        info: DistInfo,
        grad_clip: float,
        attention: AttentionBackend,
        autocast: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        self.model = model
        self.ddp_model = ddp_model
        self.params = params
        self.optimizer = optimizer
        self.drafter_config = drafter_config
        self.info = info
        self.grad_clip = grad_clip
        self.attention = attention
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()

    def __call__(self, inputs: Sequence[DrafterInputs], padding: Sequence[bool]) -> StepOutcome:
        """One step over this rank's microbatches (``padding[i]``: a filler microbatch of zero weight)."""
        accumulator = self.accumulate_gradients(inputs, padding)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(
            stats_S=all_reduce_sum(accumulator.pack(), self.info),
            grad_norm=grad_norm,
            block_size=self.drafter_config.block_size,
        )

    def accumulate_gradients(
        self, inputs: Sequence[DrafterInputs], padding: Sequence[bool]
    ) -> StepAccumulator:
        """Backpropagate each microbatch's Σ w·CE scaled by the step's all-rank weight (module
        docstring); DDP all-reduces the gradients once, on the last microbatch."""
        info = self.info
        real = [0.0 if p else 1.0 for p in padding]  # padding microbatches weigh nothing
        weights = [loss_weight(x, self.drafter_config) * r for x, r in zip(inputs, real, strict=True)]
        total_weight = all_reduce_sum(torch.stack(weights).sum(), info)
        scale = torch.where(total_weight > 0, info.world_size / total_weight.clamp_min(1e-30), 0.0)
        accumulator = StepAccumulator(self.drafter_config.block_size, info.device)
        for i, x in enumerate(inputs):
            sync = i == len(inputs) - 1 or not info.distributed
            no_sync = contextlib.nullcontext() if sync else self.ddp_model.no_sync()  # type: ignore[operator]
            with no_sync, self.autocast:
                out = self.ddp_model(x, attention=self.attention)
            (out.weighted_ce_sum * (scale.float() * real[i])).backward()
            if not padding[i]:
                accumulator.add(out)
        return accumulator
