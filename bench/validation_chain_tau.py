"""Split the gap between a training run's validation τ and ``dflash eval``'s τ into its definitional parts.

Runs the drafter's training forward (the validation split's packing and cached features, as
``dflash train``'s validator does) at *every* eligible anchor of the run's validation samples, keeps the
leading run of correct block positions at each (``train/validation.py:acceptance_at_every_anchor``), and
reports, on the same teacher-forced drafts:

- ``uniform``: 1 + the mean run over every eligible anchor: train's ``val_block_tau`` (its anchors are a
  uniform draw of these);
- ``uniform_first``: the same over the anchors eval would cover: the first ``--max-new-tokens`` answer
  tokens of each sample's first assistant turn (``--turns first``);
- ``chain_first``: eval's anchor rule over those drafts: the first cycle anchored on the answer's first
  token, the next one where the previous ended (n ← n + run + 1), until ``--max-new-tokens``; τ = mean
  over cycles of run + 1. ``tests/eval/test_train_eval_agreement.py`` checks that eval accepts exactly
  these runs at these anchors when the context is the cached answer;
- ``chain_every_turn``: the same rule over the first ``--max-new-tokens`` tokens of every assistant turn:
  ``dflash train``'s ``val_chain_tau`` with ``--val-chain-tokens`` M, the best export's criterion (the
  validator draws these blocks from the cached features itself; here they come from the exported drafter);
- ``chain_all``: the same rule over every assistant turn, whole.

uniform → uniform_first is the positions eval covers; uniform_first → chain_first the anchor selection;
what separates chain_first from eval's measured τ on the validation set (``dflash eval --bench validation
--turns first --max-new-tokens M``) is everything else: live against cached features (dtype, kernels),
free-running against teacher-forced context, the answer's end, re-tokenized answers.

    python bench/validation_chain_tau.py --run RUN [--max-new-tokens 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dflash_offline.eval.run import load_drafter_for
from dflash_offline.target_model.loader import load_target
from dflash_offline.train.config import saved_options
from dflash_offline.train.validation import acceptance_at_every_anchor, answer_turns, chain_window, walk_chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a dflash train run directory")
    parser.add_argument("--drafter", type=Path, help="its export (default RUN/drafter)")
    parser.add_argument("--target", help="the target spec (default: the run's, else the cache's)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="eval's --max-new-tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--anchor-chunk", type=int, default=1024, help="anchors per forward")
    args = parser.parse_args()
    config = saved_options(json.loads((args.run / "config.json").read_text()))
    target_spec = args.target or config.get("target")
    if target_spec is None:
        from dflash_offline.cache.layout import read_fingerprint

        target_spec = read_fingerprint(Path(config["cache_dir"])).target_id
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    target = load_target(target_spec, device=args.device, dtype=dtype)
    model = load_drafter_for(target, args.drafter or args.run / "drafter", dtype=dtype)
    per_sample = acceptance_at_every_anchor(
        args.run, model, device=args.device, anchor_chunk=args.anchor_chunk, loader_threads=2
    )
    uniform, uniform_first, chain_first, chain_every_turn, chain_all = [], [], [], [], []
    M = args.max_new_tokens
    for sample in per_sample.values():
        runs = sample.accepted_by_position
        uniform += list(runs.values())
        turns = answer_turns(sample.loss_mask)
        if not turns:
            continue
        first = chain_window(turns[0], M)
        uniform_first += [r for n, r in runs.items() if n in first]
        chain_first += walk_chain(runs, first)
        for turn in turns:
            chain_every_turn += walk_chain(runs, chain_window(turn, M))
            chain_all += walk_chain(runs, turn)
    result = {
        "samples": len(per_sample),
        "max_new_tokens": M,
        "uniform": 1 + float(np.mean(uniform)),
        "uniform_first": 1 + float(np.mean(uniform_first)),
        "chain_first": 1 + float(np.mean(chain_first)),
        "chain_every_turn": 1 + float(np.mean(chain_every_turn)),
        "chain_all": 1 + float(np.mean(chain_all)),
        "anchors": {"uniform": len(uniform), "uniform_first": len(uniform_first)},
        "cycles": {
            "chain_first": len(chain_first),
            "chain_every_turn": len(chain_every_turn),
            "chain_all": len(chain_all),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
