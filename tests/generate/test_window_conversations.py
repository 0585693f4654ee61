"""``dflash generate --window-limit`` routes validation samples by conversation (docs/follow.md): every
sample of one conversation (ShareGPT's records ``X_0``, ``X_11``, … of one long conversation; other answers
to the same prompts under one record id) lands in a validation store or every one in training stores, as
``dflash train --val-group root-id`` would split them; a split by sample would train on a validation
sample's sibling."""

from __future__ import annotations

from pathlib import Path

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.window import is_validation_store
from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import conversation_root, iter_records
from dflash_offline.generate.run import run_generate
from dflash_offline.train.snapshot import validation_key, validation_mask

from .helpers import make_conversations_jsonl, tiny_config

VAL_FRACTION = 0.3


def related_records(where: Path) -> tuple[Path, dict[str, str]]:
    """A data file of related records whose per-sample key would split some conversation across the two
    sides while its conversations fall on both sides (searched over seeds); with each sample's root, taken
    from the records as ``dflash generate`` parses them."""
    for seed in range(100):
        data = make_conversations_jsonl(where / f"related-{seed}.jsonl", seed=seed)
        root_of = {
            r.sample_id: conversation_root(r.record_id, r.sample_id)
            for r in iter_records(data)
            if isinstance(r, Conversation)
        }
        sides: dict[str, set[bool]] = {}
        for sample_id, root in root_of.items():
            sides.setdefault(root, set()).add(validation_key(sample_id) < VAL_FRACTION)
        held_roots = sum(validation_key(r) < VAL_FRACTION for r in sides)
        if any(len(s) == 2 for s in sides.values()) and 0 < held_roots < len(sides):
            return data, root_of
    raise AssertionError("no seed gives a conversation that a split by sample would cut in two")


def test_window_generate_routes_whole_conversations(tmp_path: Path) -> None:
    data, root_of = related_records(tmp_path)
    assert len(set(root_of.values())) < len(root_of)  # records share conversations
    cache = tmp_path / "cache"
    config = tiny_config(cache, data, window_limit=10**9, store_size=30_000, val_fraction=VAL_FRACTION)
    assert run_generate(config).status == "finished"

    rows = read_table(cache, "samples", ["sample_id", "shard", "conversation_root"]).to_pydict()
    assert sorted(rows["sample_id"]) == sorted(root_of)
    stored_root = dict(zip(rows["sample_id"], rows["conversation_root"], strict=True))
    assert stored_root == root_of  # the row holds the root the record gives
    held_out = {
        s for s, shard in zip(rows["sample_id"], rows["shard"], strict=True) if is_validation_store(shard)
    }
    sides: dict[str, set[bool]] = {}
    for sample_id, root in root_of.items():
        sides.setdefault(root, set()).add(sample_id in held_out)
    assert all(len(s) == 1 for s in sides.values())  # no conversation on both sides
    # The reference: the split of ``dflash train --val-group root-id`` over the same samples and roots.
    ids = sorted(root_of)
    mask = validation_mask(ids, fraction=VAL_FRACTION, num_samples=None, groups=root_of)
    assert held_out == {s for s, m in zip(ids, mask, strict=True) if m}
    assert 0 < len(held_out) < len(ids)
    assert any(len([s for s in held_out if root_of[s] == r]) > 1 for r in {root_of[s] for s in held_out})
