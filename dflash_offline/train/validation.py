"""Validation during training: loss, accuracy per block position and τ of the held-out split, with
the chain τ of ``dflash eval``'s anchor rule."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.cache.reader import CacheReader
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.anchors import eligible_anchor_mask
from dflash_offline.drafter.attention import AttentionBackend
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import TrainConfig, saved_options
from dflash_offline.train.loader import Prefetcher, RowReader
from dflash_offline.train.metrics import StepAccumulator, ValidationMetrics, all_reduce_sum
from dflash_offline.train.planner import (
    AnchorRequest,
    MicrobatchPlan,
    PackedMicrobatch,
    ScheduledMicrobatch,
    anchor_seed,
)
from dflash_offline.train.snapshot import (
    GROUPS_FILE,
    SNAPSHOT_FILE,
    IndexSnapshot,
    SplitSnapshots,
    bind_snapshot,
    held_out_of_run,
    read_groups,
    read_snapshot,
    split_snapshot,
)
from dflash_offline.train.step import anchor_sampler

# ─── Chain τ ────────────────────────────────────────────────────────────────────────────────────────────────
# ``val_chain_tau``: ``dflash eval``'s anchor rule applied to the training forward's drafts.
#
# Shape legend: T = tokens of a packed row, A = anchors.
#
# The validator's per-block τ (``val_block_tau``) averages blocks at a uniform draw of every eligible anchor
# of every answer. ``dflash eval`` measures something narrower: it decodes the first ``--max-new-tokens``
# M tokens of an answer in draft–verify cycles, the first anchored on the answer's first token (the one
# the prefill produced), each next one where the last ended, n ← n + accepted + 1, while fewer than M
# tokens are out (n < start + M − 1). Its anchors therefore sit early in answers and right after a
# rejection, where drafting is hardest: on a SmolLM2-135M H200 run (docs/facts.md, RUN/drafter) the uniform
# mean read 2.72 where this chain read 1.97 over whole turns and eval measured 1.54
# (``bench/validation_chain_tau.py`` splits the gap).
#
# Here that rule walks the drafts the training forward makes at every anchor of each assistant turn's
# first M tokens (``DFlashDrafter.block_runs``: the cached tokens as context, which is what eval's context
# is where its target reproduces the cached answer): one chain per turn, every turn of every sample, τ =
# mean over all cycles of (run + 1). ``tests/eval/test_train_eval_agreement.py`` checks that it equals
# eval's measured τ on the validation records when the cached answers cover every block.
#
# At a turn's end the teacher-forced drafts differ from eval's: a block past the turn's last loss position
# counts as rejected there (its labels end), and no cycle starts on the turn's last token (no position
# after it carries loss), where eval verifies against the target's own continuation. A turn is one run of
# the loss mask (``answer_turns``), as the cache marks the answers.


def answer_turns(
    loss_mask: Sequence[bool] | np.ndarray, doc_ids: Sequence[int] | np.ndarray | None = None
) -> list[range]:
    """The assistant turns of a sample (or of a packed row, with its ``doc_ids``): each run of loss-mask
    positions, cut where the document changes, as the range of its positions."""
    mask = np.asarray(loss_mask, dtype=bool)
    if mask.size == 0:
        return []
    docs = np.zeros(mask.size, dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
    joins_previous = np.zeros(mask.size, dtype=bool)
    joins_previous[1:] = mask[1:] & mask[:-1] & (docs[1:] == docs[:-1])
    joins_next = np.zeros(mask.size, dtype=bool)
    joins_next[:-1] = joins_previous[1:]
    starts = np.flatnonzero(mask & ~joins_previous)
    stops = np.flatnonzero(mask & ~joins_next) + 1
    return [range(int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


def chain_window(turn: range, max_new_tokens: int | None) -> range:
    """Where eval's cycles may start in ``turn``: from its first token while fewer than ``max_new_tokens``
    tokens are out (the first comes from the prefill: n < start + M − 1); None: the whole turn."""
    if max_new_tokens is None:
        return turn
    return range(turn.start, min(turn.stop, turn.start + max_new_tokens - 1))


def walk_chain(runs: Mapping[int, int], window: range) -> list[int]:
    """Eval's cycles over teacher-forced drafts: the runs at n = window.start, then n + run + 1, … while n
    is in the window and a block starts there (``runs``: anchor position → leading run of correct
    positions). A block may run past the window's end, as eval's last cycle does."""
    cycles: list[int] = []
    n = window.start
    while n < window.stop and n in runs:
        cycles.append(runs[n])
        n += runs[n] + 1
    return cycles


TURN_GROUPS = ("1", "2", "3+")
"""The turns chain τ is also reported by, as ``dflash eval`` reports its τ: a sample's first assistant turn
(no earlier answer of the target in its prompt), its second, and every later one."""


def turn_group(ordinal: int) -> int:
    """The index in ``TURN_GROUPS`` of a sample's ``ordinal``-th assistant turn (1-based)."""
    return min(ordinal, len(TURN_GROUPS)) - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainCycles:
    """The cycles of one packed row's chains (every turn of every document), by ``TURN_GROUPS`` (the turn's
    ordinal within its document)."""

    cycles_by_turn: tuple[int, ...]
    """Draft–verify cycles eval's rule makes over the row's chain windows."""
    tokens_by_turn: tuple[int, ...]
    """Σ (run + 1) over those cycles: the tokens they produce."""

    @property
    def num_cycles(self) -> int:
        return sum(self.cycles_by_turn)

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_turn)


def block_runs_at(
    model: DFlashDrafter,
    inputs: DrafterInputs,
    anchors_A: torch.Tensor,
    *,
    attention: AttentionBackend,
    anchor_chunk: int,
) -> torch.Tensor:
    """int64 [A] on the row's device: ``model.block_runs`` of ``inputs`` with a block at each of
    ``anchors_A``, ``anchor_chunk`` blocks per forward (as many as a training microbatch bounds memory)."""
    runs = [
        model.block_runs(
            replace(inputs, anchors_A=anchors_A[c : c + anchor_chunk], loss_rows_N=None), attention=attention
        )
        for c in range(0, len(anchors_A), anchor_chunk)
    ]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64, device=anchors_A.device)


def row_chain_cycles(
    model: DFlashDrafter,
    inputs: DrafterInputs,
    *,
    max_new_tokens: int,
    attention: AttentionBackend,
    anchor_chunk: int,
) -> ChainCycles:
    """Eval's cycles over the first ``max_new_tokens`` tokens of every turn of the row ``inputs``: the
    training forward at every anchor of those windows, then one chain walk per turn (a host sync)."""
    loss_mask_T, doc_ids_T = inputs.loss_mask_T.cpu(), inputs.doc_ids_T.cpu()
    turns = answer_turns(loss_mask_T.numpy(), doc_ids_T.numpy())
    windows = [chain_window(turn, max_new_tokens) for turn in turns]
    # Each turn's TURN_GROUPS index, from its ordinal within its document.
    groups: list[int] = []
    seen_in_doc: dict[int, int] = {}
    for turn in turns:
        doc = int(doc_ids_T[turn.start])
        seen_in_doc[doc] = seen_in_doc.get(doc, 0) + 1
        groups.append(turn_group(seen_in_doc[doc]))
    in_window_T = torch.zeros_like(loss_mask_T, dtype=torch.bool)
    for window in windows:
        in_window_T[window.start : window.stop] = True
    anchors_A = torch.nonzero(in_window_T & eligible_anchor_mask(loss_mask_T, doc_ids_T)).flatten()
    runs_A = block_runs_at(
        model, inputs, anchors_A.to(inputs.anchors_A.device), attention=attention, anchor_chunk=anchor_chunk
    )
    runs = dict(zip(anchors_A.tolist(), runs_A.tolist(), strict=True))
    cycles_by_turn, tokens_by_turn = [0] * len(TURN_GROUPS), [0] * len(TURN_GROUPS)
    for window, group in zip(windows, groups, strict=True):
        cycles = walk_chain(runs, window)
        cycles_by_turn[group] += len(cycles)
        tokens_by_turn[group] += sum(run + 1 for run in cycles)
    return ChainCycles(cycles_by_turn=tuple(cycles_by_turn), tokens_by_turn=tuple(tokens_by_turn))


# ─── The validator ──────────────────────────────────────────────────────────────────────────────────────────
# Validation during training: loss, accuracy per block position and simulated τ of the held-out split.
#
# The split (train/snapshot.py) is packed once into microbatches under the training token budget, shortest
# samples first, in a fixed order; each microbatch's anchors are drawn by the training rule with a seed
# fixed by its sample ids alone (not the run's seed, not the step), so every evaluation of every run
# over the same split sees the same blocks and the values are comparable across steps and runs. On DDP
# rank r evaluates microbatches r, r + world, …; the sums are all-reduced, so the result is the whole
# split's whatever the world size. Loss and accuracies are pooled exactly as the training step's are
# (Σ w·CE / Σ w, correct / total per position): one number over the whole split, not a mean of means.
#
# Each microbatch is also run with a block at every anchor of its turns' first ``--val-chain-tokens``
# tokens, and ``dflash eval``'s anchor rule walks those drafts (train/validation.py): ``val_chain_tau``, the
# τ eval would measure where its target reproduces the cached answers. The uniform draw overstates it (late
# answer positions are easier, and eval's anchors sit right after a rejection), so
# ``ValidationTracker`` keeps the best chain τ for the best-drafter export and ``--early-stop``; it is saved
# in every checkpoint, so a resumed run decides as the uninterrupted one would have.
#
# ``acceptance_at_every_anchor`` runs the same forward over a finished run's split with a block at every
# eligible anchor instead of a draw: what each block drafts correctly, where eval's cycles would start.


VALIDATION_ANCHOR_SEED = 0x7661_6C69
"""The anchor seed of every validation microbatch (with its sample ids): fixed, whatever ``--seed``."""


def plan_validation(snapshot: IndexSnapshot, *, tokens_per_microbatch: int) -> list[MicrobatchPlan]:
    """The split's microbatches: samples by length (then id), packed greedily under the budget."""
    order = np.lexsort((np.arange(len(snapshot)), snapshot.num_tokens_N))
    plans: list[MicrobatchPlan] = []
    current: list[int] = []
    tokens = 0

    def close() -> None:
        plans.append(
            MicrobatchPlan(
                index_in_step=len(plans),
                rank=0,
                rows=tuple(current),
                sample_ids=tuple(snapshot.sample_ids[p] for p in current),
                bucket_ids=tuple(int(snapshot.bucket_ids_N[p]) for p in current),
                num_tokens=sum(int(snapshot.num_tokens_N[p]) for p in current),
            )
        )

    for position in order.tolist():
        n = int(snapshot.num_tokens_N[position])
        if current and tokens + n > tokens_per_microbatch:
            close()
            current, tokens = [], 0
        current.append(position)
        tokens += n
    if current:
        close()
    return plans


def validation_jobs(snapshot: IndexSnapshot, plans: list[MicrobatchPlan]) -> list[ScheduledMicrobatch]:
    """The prefetcher's jobs for ``plans`` of the split ``snapshot`` (bound to the reader), each with
    the anchor seed fixed by its sample ids."""
    return [
        ScheduledMicrobatch(
            plan=plan,
            reader_rows=tuple(int(r) for r in snapshot.reader_rows_N[list(plan.rows)]),
            anchor_seed=anchor_seed(VALIDATION_ANCHOR_SEED, 0, plan.sample_ids),
        )
        for plan in plans
    ]


class Validator:
    """Evaluates a drafter on the split (module docstring); one per rank, built once per run."""

    def __init__(
        self,
        snapshot: IndexSnapshot,
        reader: RowReader,
        *,
        info: DistInfo,
        tokens_per_microbatch: int,
        prefetch: int,
        loader_threads: int,
        attention: AttentionBackend,
        chain_tokens: int,
        autocast: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        """``chain_tokens``: the answer tokens per turn that chain τ covers (eval's --max-new-tokens)."""
        self.snapshot = snapshot
        self.chain_tokens = chain_tokens
        self._reader = reader
        self._info = info
        self._prefetch = prefetch
        self._threads = loader_threads
        self._attention = attention
        self._autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.plans = plan_validation(snapshot, tokens_per_microbatch=tokens_per_microbatch)
        self._mine = self.plans[info.rank :: info.world_size]

    @property
    def num_samples(self) -> int:
        return len(self.snapshot)

    @torch.no_grad()
    def evaluate(self, model: DFlashDrafter, step: int) -> ValidationMetrics:
        """The split's metrics for ``model`` now (every rank must call it: the sums are all-reduced)."""
        block_size = model.config.block_size
        accumulator = StepAccumulator(block_size, self._info.device)
        # Σ (run + 1) over this rank's cycles by turn (chain_tau.TURN_GROUPS), then their counts by turn.
        chain_counts = [0] * (2 * len(TURN_GROUPS))
        with Prefetcher(
            self._reader,
            validation_jobs(self.snapshot, self._mine),
            device=self._info.device,
            prefetch=self._prefetch,
            num_threads=self._threads,
            anchor_fn=anchor_sampler(model.config.num_anchors),
            loss_block_size=block_size,
        ) as prefetcher:
            for batch in prefetcher:
                with self._autocast:
                    accumulator.add(model(batch.inputs, attention=self._attention))
                    # As many blocks per forward as a training microbatch holds: its memory bound.
                    chain = row_chain_cycles(
                        model,
                        batch.inputs,
                        max_new_tokens=self.chain_tokens,
                        attention=self._attention,
                        anchor_chunk=model.config.num_anchors,
                    )
                counts = (*chain.tokens_by_turn, *chain.cycles_by_turn)
                chain_counts = [a + b for a, b in zip(chain_counts, counts, strict=True)]
        totals = accumulator.reduce(self._info)
        chain_sums = all_reduce_sum(
            torch.tensor(chain_counts, dtype=torch.float64, device=self._info.device), self._info
        ).tolist()
        tokens_by_turn, cycles_by_turn = chain_sums[: len(TURN_GROUPS)], chain_sums[len(TURN_GROUPS) :]
        tokens, cycles = sum(tokens_by_turn), sum(cycles_by_turn)  # integers: exact in float64
        return ValidationMetrics(
            step=step,
            loss=totals.loss,
            acc_by_position=totals.acc_by_position,
            simulated_tau=totals.simulated_tau,
            block_tau=totals.block_tau,
            chain_tau=tokens / cycles if cycles > 0 else 1.0,
            chain_cycles=int(cycles),
            chain_tau_by_turn=tuple(
                t / c if c > 0 else None for t, c in zip(tokens_by_turn, cycles_by_turn, strict=True)
            ),
            num_blocks=totals.num_blocks,
            num_samples=len(self.snapshot),
            num_tokens=self.snapshot.total_tokens,
        )


TRACKER_STATE_VERSION = 2
"""``ValidationTracker.state_dict``'s version: 2 tracks chain τ; 1 (before it) tracked simulated τ."""


class ValidationTracker:
    """The best validation chain τ so far and the evaluations since (for the best export and early stop).

    Chain τ over ``chain_tokens`` answer tokens per turn is the criterion (module docstring). A checkpoint
    tracking another one (simulated τ, before chain τ existed, or chain τ over another
    ``--val-chain-tokens``) holds a best of other units: its state is set aside and the next evaluation
    is the best so far (``restarted`` says why)."""

    def __init__(self, *, chain_tokens: int) -> None:
        self.chain_tokens = chain_tokens
        self.best_tau: float | None = None
        self.best_step = 0
        self.evals_since_best = 0
        self.restarted: str | None = None
        """Why a resumed state was set aside (None: restored, or a fresh run)."""

    def update(self, metrics: ValidationMetrics) -> bool:
        """Record an evaluation; True when its chain τ is the best so far (strictly)."""
        if self.best_tau is None or metrics.chain_tau > self.best_tau:
            self.best_tau, self.best_step, self.evals_since_best = metrics.chain_tau, metrics.step, 0
            return True
        self.evals_since_best += 1
        return False

    def should_stop(self, early_stop: int | None) -> bool:
        return early_stop is not None and self.best_tau is not None and self.evals_since_best >= early_stop

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": TRACKER_STATE_VERSION,
            "chain_tokens": self.chain_tokens,
            "best_tau": self.best_tau,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a fresh run: nothing to restore
            return
        version = state.get("version")
        if version not in (1, TRACKER_STATE_VERSION):
            raise ResumeError(
                f"the checkpoint's validation tracker has version {version!r}, this dflash-offline reads "
                f"{TRACKER_STATE_VERSION}; train into a new {field_ref(TrainConfig, 'out_dir')} directory"
            )
        tracked = "simulated τ" if version == 1 else f"chain τ over {state['chain_tokens']} tokens per turn"
        if version == 1 or int(state["chain_tokens"]) != self.chain_tokens:
            self.restarted = (
                f"the checkpoint's best validation {tracked} (step {int(state['best_step'])}) is not "
                f"comparable with chain τ over {self.chain_tokens} tokens: the next validation starts the "
                "best export and the early-stop count afresh"
            )
            return
        self.best_tau = None if state["best_tau"] is None else float(state["best_tau"])
        self.best_step = int(state["best_step"])
        self.evals_since_best = int(state["evals_since_best"])


class ValidationSchedule:
    """A run's validation: when it is due, the evaluation, the best-τ tracker, the best export and
    early stopping."""

    def __init__(
        self,
        validator: Validator,
        *,
        state: dict[str, Any],
        val_every: int,
        early_stop: int | None,
        best_export_dir: Path | None,
    ) -> None:
        """``state``: the tracker's state from the checkpoint resumed ({} when fresh);
        ``best_export_dir``: where the best drafter is exported (None: nowhere, e.g. on other ranks)."""
        self.validator = validator
        self.tracker = ValidationTracker(chain_tokens=validator.chain_tokens)
        self.tracker.load_state_dict(state)
        self._val_every = val_every
        self._early_stop = early_stop
        self._best_export_dir = best_export_dir

    def due(self, global_step: int, total_steps: int) -> bool:
        return global_step % self._val_every == 0 or global_step == total_steps

    def evaluate(self, model: DFlashDrafter, global_step: int) -> ValidationMetrics:
        """The split's metrics now (every rank must call it); ``keep_best`` records them."""
        return self.validator.evaluate(model, global_step)

    def keep_best(self, model: DFlashDrafter, metrics: ValidationMetrics) -> None:
        """Track ``metrics`` (``model``'s), and export the drafter when its chain τ is the best so far
        (timed apart from the evaluation: an export is a checkpoint's kind of cost)."""
        if self.tracker.update(metrics) and self._best_export_dir is not None:
            from dflash_offline.drafter.export import export_drafter

            export_drafter(model, self._best_export_dir)

    def should_stop(self) -> bool:
        return self.tracker.should_stop(self._early_stop)

    def stop_reason(self) -> str:
        t = self.tracker
        return (
            f"early stop: {t.evals_since_best} validations without a better chain τ than "
            f"{t.best_tau:.4f} (step {t.best_step}, the export in OUT/drafter)"
        )


# ─── A finished run's validation split ──────────────────────────────────────────────────────────────────────
# A finished run's split, recomputed as the run computed it from the files it saved (config.json, the
# snapshot, the groups; train/snapshot.py): the samples ``acceptance_at_every_anchor`` measures.


def validation_ids_of_run(run_dir: Path) -> frozenset[str] | None:
    """The validation sample ids of a ``dflash train`` run (from its config.json and saved snapshot);
    None when ``run_dir`` is not a run, has no snapshot yet, or holds nothing out."""
    validation = validation_split_of_run(run_dir)
    return None if validation is None else frozenset(validation.sample_ids)


def validation_split_of_run(run_dir: Path) -> IndexSnapshot | None:
    """The validation split of a ``dflash train`` run, as the run took it (its config.json, saved snapshot
    and groups), bound to no reader; None when ``run_dir`` is not a run, has no snapshot yet, or holds
    nothing out."""
    split = split_of_run(run_dir)
    return None if split is None else split.validation


def split_of_run(run_dir: Path) -> SplitSnapshots | None:
    """A ``dflash train`` run's split, recomputed as the run computed it (config.json, the saved snapshot
    and groups); None when ``run_dir`` is not a run or has no snapshot yet."""
    try:
        config = saved_options(json.loads((run_dir / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, ConfigError):
        return None
    if not (run_dir / SNAPSHOT_FILE).is_file():
        return None
    fraction = config.get("val_fraction")
    num_samples = config.get("val_samples")
    train_samples = config.get("train_samples")
    if not isinstance(fraction, int | float) or not (num_samples is None or isinstance(num_samples, int)):
        return None
    if not (train_samples is None or isinstance(train_samples, int)):
        return None
    groups = None
    held_out = held_out_of_run(run_dir)
    if held_out is None and config.get("val_group") == "root-id":
        if not (run_dir / GROUPS_FILE).is_file():
            return None
        groups = read_groups(run_dir / GROUPS_FILE)
    snapshot = read_snapshot(run_dir / SNAPSHOT_FILE)
    try:
        return split_snapshot(
            snapshot,
            fraction=float(fraction),
            num_samples=num_samples,
            groups=groups,
            train_samples=train_samples,
            held_out=held_out,
        )
    except ConfigError:  # not a split the run could have taken (its files were changed): no answer
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class AnchorAcceptance:
    """One validation sample under the training forward with a block at every eligible anchor."""

    accepted_by_position: dict[int, int]
    """Anchor position in the sample → the leading run of correct positions of its block (0..B−1): the
    drafts a speculative decoder accepts there with the sample's own tokens as its context."""
    input_ids: list[int]
    """The sample's cached token ids."""
    loss_mask: list[bool]
    """Its cached loss mask (True on the tokens trained on: the answers)."""


def acceptance_at_every_anchor(
    run_dir: Path,
    model: DFlashDrafter,
    *,
    device: torch.device | str = "cpu",
    attention: AttentionBackend = "auto",
    anchor_chunk: int | None = None,
    loader_threads: int = 1,
) -> dict[str, AnchorAcceptance]:
    """Sample id → the training forward of ``model`` over run ``run_dir``'s validation split (packed as
    the validator packs it, from the cached features) with a block at every eligible anchor.

    The validator's ``val_block_tau`` averages a uniform draw of these blocks; at the anchors where
    ``dflash eval``'s cycles start, they are what eval accepts on the cached answer
    (tests/eval/test_train_eval_agreement.py; bench/validation_chain_tau.py splits the gap between the
    two). ``anchor_chunk``: blocks per forward (None: all of a microbatch's at once)."""

    config = saved_options(json.loads((run_dir / "config.json").read_text()))
    split = validation_split_of_run(run_dir)
    if split is None:
        raise ConfigError(f"{run_dir}: not a dflash train run that holds samples out for validation")
    out: dict[str, AnchorAcceptance] = {}
    with CacheReader.open(Path(config["cache_dir"])) as reader:
        validation = bind_snapshot(split, reader)
        plans = plan_validation(validation, tokens_per_microbatch=config["tokens_per_microbatch"])
        with Prefetcher(
            reader,
            validation_jobs(validation, plans),
            device=device,
            anchor_fn=_every_eligible_anchor,
            num_threads=loader_threads,
        ) as prefetcher:
            for batch in prefetcher:
                out.update(_acceptance(batch, model, attention=attention, anchor_chunk=anchor_chunk))
    return out


def _every_eligible_anchor(request: AnchorRequest) -> torch.Tensor:
    return torch.nonzero(eligible_anchor_mask(request.loss_mask_T, request.doc_ids_T)).flatten()


@torch.no_grad()
def _acceptance(
    batch: PackedMicrobatch, model: DFlashDrafter, *, attention: AttentionBackend, anchor_chunk: int | None
) -> dict[str, AnchorAcceptance]:
    """``acceptance_at_every_anchor`` of one microbatch's samples."""
    inputs = batch.inputs
    ids, starts = batch.plan.sample_ids, batch.cu_seqlens_D1.tolist()
    out = {
        sample_id: AnchorAcceptance(
            accepted_by_position={},
            input_ids=inputs.input_ids_T[starts[d] : starts[d + 1]].tolist(),
            loss_mask=inputs.loss_mask_T[starts[d] : starts[d + 1]].bool().tolist(),
        )
        for d, sample_id in enumerate(ids)
    }
    anchors_A = inputs.anchors_A
    runs_A = block_runs_at(
        model, inputs, anchors_A, attention=attention, anchor_chunk=anchor_chunk or max(len(anchors_A), 1)
    )
    for a, accepted in zip(anchors_A.tolist(), runs_A.tolist(), strict=True):
        sample = out[ids[int(inputs.doc_ids_T[a])]]
        sample.accepted_by_position[int(inputs.positions_T[a])] = accepted
    return out
