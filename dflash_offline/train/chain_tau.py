"""``val_chain_tau``: ``dflash eval``'s anchor rule applied to the training forward's drafts.

Shape legend: T = tokens of a packed row, A = anchors.

The validator's per-block τ (``val_block_tau``) averages blocks at a uniform draw of every eligible anchor
of every answer. ``dflash eval`` measures something narrower: it decodes the first ``--max-new-tokens``
M tokens of an answer in draft–verify cycles, the first anchored on the answer's first token (the one
the prefill produced), each next one where the last ended, n ← n + accepted + 1, while fewer than M
tokens are out (n < start + M − 1). Its anchors therefore sit early in answers and right after a
rejection, where drafting is hardest: on a SmolLM2-135M H200 run (docs/facts.md, RUN/drafter) the uniform mean
read 2.72 where this chain read 1.97 over whole turns and eval measured 1.54
(``bench/validation_chain_tau.py`` splits the gap).

Here that rule walks the drafts the training forward makes at every anchor of each assistant turn's
first M tokens (``DFlashDrafter.block_runs``: the cached tokens as context, which is what eval's context
is where its target reproduces the cached answer): one chain per turn, every turn of every sample, τ =
mean over all cycles of (run + 1). ``tests/eval/test_train_eval_agreement.py`` checks that it equals
eval's measured τ on the validation records when the cached answers cover every block.

At a turn's end the teacher-forced drafts differ from eval's: a block past the turn's last loss position
counts as rejected there (its labels end), and no cycle starts on the turn's last token (no position
after it carries loss), where eval verifies against the target's own continuation. A turn is one run of
the loss mask (``answer_turns``), as the cache marks the answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dflash_offline.drafter.anchors import eligible_anchor_mask
from dflash_offline.drafter.attention import AttentionBackend
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.model import DFlashDrafter


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
