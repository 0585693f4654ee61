"""One optimizer step and what it needs: the drafter built for a cache, seeds and deterministic kernels,
and an out-of-memory error that names the options that set a step's memory."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.anchors import sample_anchors
from dflash_offline.drafter.attention import AttentionBackend
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.loss import block_labels, decay_weights
from dflash_offline.drafter.mask_token import resolve_mask_token_id
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError, DrafterFormatError
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import (
    CheckpointConfig,
    DataConfig,
    DrafterTrainConfig,
    LaunchConfig,
    TopologyConfig,
    TrainConfig,
)
from dflash_offline.train.metrics import StepAccumulator, StepTotals, all_reduce_sum
from dflash_offline.train.planner import AnchorRequest

# ─── Determinism ────────────────────────────────────────────────────────────────────────────────────────────
# ``--deterministic``: seeds everything and enforces deterministic kernels (a refactor must not
# change the loss curve under it). Enforced, not advised: an operation without a deterministic kernel
# raises where it runs instead of warning and silently breaking the "same loss curve" promise.


CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
"""The workspace settings under which cuBLAS is deterministic (CUDA docs, "Results reproducibility")."""


class DeterminismError(ConfigError):
    """``--deterministic`` was asked for where determinism cannot be had."""


def seed_everything(seed: int, *, deterministic: bool) -> None:
    """The one determinism switch: seeds Python, numpy and torch; with ``deterministic``, turns on
    deterministic kernels (no ``warn_only``) and cuBLAS's deterministic workspace, or raises."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not deterministic:
        return
    cublas = os.environ.setdefault(CUBLAS_ENV, DETERMINISTIC_CUBLAS[0])
    if cublas not in DETERMINISTIC_CUBLAS:
        raise DeterminismError(
            f"{field_ref(LaunchConfig, 'deterministic')}: ${CUBLAS_ENV}={cublas!r} makes cuBLAS "
            f"non-deterministic; unset it or set it to {' or '.join(DETERMINISTIC_CUBLAS)}"
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# ─── Out of memory ──────────────────────────────────────────────────────────────────────────────────────────
# An out-of-memory error of a training step or a validation, turned into one that says which options set a
# microbatch's size and what to give instead.


@contextlib.contextmanager
def out_of_memory_named(config: TrainConfig, info: DistInfo, during: str) -> Iterator[None]:
    """An out-of-memory error becomes one that names the options setting a microbatch's size and what to
    give instead: the same tokens and blocks a step in more, smaller microbatches. The defaults on GPUs
    (one microbatch of 32k tokens and 2,048 blocks) need ≈ 6 GiB at SmolLM2 width and ≈ 59 GiB at
    Qwen3-8B width (bench/RESULTS.md)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        tokens_flag = field_ref(DataConfig, "tokens_per_microbatch")
        anchors_flag = field_ref(DataConfig, "num_anchors")
        accum_flag = field_ref(TopologyConfig, "grad_accum")
        tokens, anchors, accum = (
            config.data.tokens_per_microbatch,
            config.data.num_anchors,
            config.topology.grad_accum,
        )
        smaller = (
            f"{tokens_flag} {max(2, tokens // 4)} {anchors_flag} {max(1, anchors // 4)} "
            f"{accum_flag} {accum * 4}"
        )
        if config.launch.fuse_microbatches:  # its rows hold the whole step: smaller ones need it off
            smaller += f" without {field_ref(LaunchConfig, 'fuse_microbatches')}"
        said = str(e).splitlines()[0] if str(e) else "out of memory"
        raise ConfigError(
            f"{during} ran out of memory on {info.device} with {tokens_flag} {tokens}, "
            f"{anchors_flag} {anchors} and {accum_flag} {accum}: a microbatch holds too much; start the "
            f"run again with smaller microbatches, e.g. {smaller} (the same tokens and blocks a step; a "
            f"resume keeps {anchors_flag}, so give a new {field_ref(TrainConfig, 'out_dir')} or "
            f"{field_ref(CheckpointConfig, 'resume')} never). The allocator said: {said}"
        ) from None


# ─── The drafter for a cache ────────────────────────────────────────────────────────────────────────────────
# Build the drafter for a cache: its shape from the target's config, its frozen embedding and LM head
# from the target's weights (those two tensors only), its layer ids from the cache fingerprint; and, for a
# run started ``--init-from`` an export, its first weights from that export.


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterSetup:
    """A freshly initialised drafter and where its frozen parts came from."""

    model: DFlashDrafter
    target_spec: str
    """The ``--target`` spec the embedding and LM head were read from."""


def target_spec_for(config_target: str | None, fingerprint: CacheFingerprint) -> str:
    """The target to borrow the head from: the explicit one, else the cache's own when it can be
    loaded by name (``default``, ``random:<preset>``). The spec must be the cache's target."""
    from dflash_offline.target_model.loader import resolve_target, target_info

    if config_target is None:
        if fingerprint.target_id == "default" or fingerprint.target_id.startswith("random:"):
            return fingerprint.target_id
        raise ConfigError(
            f"the cache was generated with target {fingerprint.target_id!r}; pass "
            f"{field_ref(DrafterTrainConfig, 'target')} with its model directory or .gguf file so that the "
            "drafter can borrow its embedding and LM head"
        )
    info = target_info(resolve_target(config_target))
    if info.weights_hash != fingerprint.weights_hash:
        raise ConfigError(
            f"{field_ref(DrafterTrainConfig, 'target')} {config_target!r} has weights hash "
            f"{info.weights_hash}, the cache was generated with {fingerprint.weights_hash} "
            f"({fingerprint.target_id}): use the cache's target"
        )
    return config_target


def build_drafter_setup(
    config: TrainConfig, fingerprint: CacheFingerprint, *, device: torch.device
) -> DrafterSetup:
    from dflash_offline.target_model.head import load_embedding_and_head
    from dflash_offline.target_model.loader import load_tokenizer

    spec = target_spec_for(config.drafter.target, fingerprint)
    head = load_embedding_and_head(spec, device=device)
    tokenizer = load_tokenizer(spec)
    mask_token_id = resolve_mask_token_id(tokenizer, head.info.vocab_size, config.drafter.mask_token_id)
    drafter_config = DrafterConfig.from_target_config(
        head.info.hf_config,
        target_layer_ids=fingerprint.layer_ids,
        mask_token_id=mask_token_id,
        num_layers=config.drafter.num_layers,
        block_size=config.drafter.block_size,
        loss_gamma=config.drafter.gamma,
        num_anchors=config.data.num_anchors,
    )
    torch.manual_seed(config.data.seed)  # the initial weights are a function of the seed
    model = DFlashDrafter(drafter_config, embed_VH=head.embed_VH, lm_head_VH=head.lm_head_VH).to(device)
    if config.drafter.final_norm_init != 1.0:
        with torch.no_grad():
            model.norm.weight.fill_(config.drafter.final_norm_init)
    return DrafterSetup(model=model, target_spec=spec)


ARCHITECTURE_FIELDS = (
    "num_layers",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
)
"""The ``DrafterConfig`` fields that shape the weights or what they compute: an export to start from must
have this run's."""


def _how_to_match(name: str) -> str:
    """What makes a run match an export that differs from it in ``name``."""
    own = {  # the run's own options
        "num_layers": field_ref(DrafterTrainConfig, "num_layers"),
        "block_size": field_ref(DrafterTrainConfig, "block_size"),
        "mask_token_id": field_ref(DrafterTrainConfig, "mask_token_id"),
    }
    if name in own:
        return f"pass {own[name]}"
    if name == "target_layer_ids":
        return "train on a cache of the same captured layers"
    return "train on a cache of that drafter's target"


def init_weights_from(model: DFlashDrafter, directory: Path) -> int:
    """Load the weights of the export in ``directory`` into the fresh training drafter ``model``, whose
    feature scale (if any) is already installed; return how many values were loaded.

    The export folds its run's feature scale into fc.weight (W·diag(s)); this run applies its own scale s'
    before fc, so fc starts at W·diag(s)·diag(1/s'): the drafter computes exactly the export's function
    (up to rounding), whatever the two caches' statistics."""
    from dflash_offline.drafter.export import load_exported_drafter, read_export_config

    init_from = field_ref(DrafterTrainConfig, "init_from")
    if not directory.is_dir():
        raise ConfigError(f"{init_from} {directory}: not a directory (an exported drafter: RUN/drafter)")
    try:
        theirs = read_export_config(directory)
    except DrafterFormatError as exc:
        raise ConfigError(f"{init_from} {directory}: {exc}") from exc
    mine = model.config
    differ = [name for name in ARCHITECTURE_FIELDS if getattr(theirs, name) != getattr(mine, name)]
    if differ:
        what = [
            f"{name} {getattr(theirs, name)} (this run: {getattr(mine, name)}; {_how_to_match(name)})"
            for name in differ
        ]
        raise ConfigError(
            f"{init_from} {directory}: that drafter differs from this run's in " + "; ".join(what)
        )
    weight = model.fc.weight
    source = load_exported_drafter(
        directory, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH, device=weight.device
    )
    state = {key: t.to(weight.dtype) for key, t in source.state_dict().items()}
    if model.feature_scale_F is not None:
        state["fc.weight"] = (source.fc.weight.float() / model.feature_scale_F[None, :]).to(weight.dtype)
    with torch.no_grad():
        result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"feature_scale_F"}, result.missing_keys
    return sum(t.numel() for t in state.values())


# ─── The optimizer step ─────────────────────────────────────────────────────────────────────────────────────
# One optimizer step of one data-parallel rank, with no host sync: what it computes stays on the device
# until someone reads it (``StepOutcome.read``, at a log step).
#
# Loss normalisation: a step's loss is Σ w·CE / Σ w over every microbatch of every rank. The weight
# sum of each microbatch is known before its forward (it depends only on anchors and labels), so the
# step's total is all-reduced first and each microbatch backpropagates ``Σ w·CE / total × world``
# (DDP averages over ranks). One process with grad_accum = 2 and two processes with grad_accum = 1
# therefore compute the same gradient up to float summation order.
#
# Host syncs a step used to make, and where they went: the loss weights' ``w[0] = 0.0`` (twice a
# microbatch: ``drafter.loss.decay_weights`` is cached and built with ``torch.where``); ``torch.nonzero``
# of the positions carrying loss (the prefetcher computes them on the host: ``DrafterInputs.loss_rows_N``);
# three ``.tolist()`` of the metrics and ``float(grad_norm)`` (``StepOutcome`` keeps them on the device);
# the stop flag's all-reduce under DDP (``train/trainer.py`` agrees on it where it reads the metrics).
#
# Shape legend: K = B − 1 block positions that carry loss.


def autocast_for(config: TrainConfig, info: DistInfo) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast with ``--autocast bf16``, or ``auto`` on CUDA; otherwise none (float32)."""
    use_bf16 = config.launch.autocast == "bf16" or (
        config.launch.autocast == "auto" and info.device.type == "cuda"
    )
    return torch.autocast(info.device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


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
