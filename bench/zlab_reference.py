"""Load an export with z-lab's own reference model code and compare its drafts with ours (CPU, seconds).

z-lab's ``dflash/model.py`` (https://github.com/z-lab/dflash) is plain torch + transformers; it is not
part of this project. Pass the path of a copy: this script exports a drafter (a seeded random one over
the ``random:tiny`` shape, or ``--export DIR``), loads it with ``DFlashDraftModel.from_pretrained``
(reporting missing and unexpected keys), runs one block with context through both models and prints the
largest difference of the final hidden states (0 when the layouts agree; both use SDPA in float32).

  python bench/zlab_reference.py --zlab-model /path/to/dflash/model.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.drafter.export import export_drafter, load_exported_drafter  # noqa: E402
from dflash_offline.drafter.model import DFlashDrafter  # noqa: E402
from dflash_offline.target_model.head import load_embedding_and_head  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--zlab-model", type=Path, required=True, help="z-lab's dflash/model.py")
    parser.add_argument(
        "--export", type=Path, default=None, help="An export directory (default: a random one)"
    )
    parser.add_argument("--target", default="random:tiny", help="The export's target (for its embedding)")
    parser.add_argument("--context", type=int, default=7, help="Context positions before the block")
    args = parser.parse_args()
    torch.manual_seed(0)
    head = load_embedding_and_head(args.target)
    export = args.export or _random_export(head)
    ours = load_exported_drafter(export, embed_VH=head.embed_VH, lm_head_VH=head.lm_head_VH).float().eval()

    spec = importlib.util.spec_from_file_location("zlab_dflash_model", args.zlab_model)
    assert spec is not None
    assert spec.loader is not None
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)
    ref, info = zlab.DFlashDraftModel.from_pretrained(
        str(export), dtype=torch.float32, output_loading_info=True
    )
    ref.eval()
    ref.config._attn_implementation = "sdpa"

    cfg = ours.config
    C, B = args.context, cfg.block_size
    features_CF = torch.randn(C, cfg.feature_width)
    anchor = 11
    ids = torch.full((B,), cfg.mask_token_id)
    ids[0] = anchor
    with torch.no_grad():
        a = ours.draft_hidden(context_features_CF=features_CF, anchor_token=anchor, anchor_position=C)
        b = ref(
            position_ids=torch.arange(C + B)[None],
            noise_embedding=head.embed_VH[ids][None].float(),
            target_hidden=features_CF[None],
            attention_mask=None,
            is_causal=False,
        )[0]
    result = {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": sorted(map(str, info["mismatched_keys"])),
        "block_size": ref.block_size,
        "mask_token_id": ref.mask_token_id,
        "target_layer_ids": list(ref.target_layer_ids),
        "max_abs_diff": float((a - b).abs().max()),
    }
    print(json.dumps(result, indent=2))


def _random_export(head: object) -> Path:
    from dflash_offline.drafter.config import DrafterConfig

    info = head.info  # type: ignore[attr-defined]
    config = DrafterConfig.from_target_config(
        info.hf_config, target_layer_ids=(0, 2), mask_token_id=16, num_layers=2, block_size=8
    )
    model = DFlashDrafter(config, embed_VH=head.embed_VH, lm_head_VH=head.lm_head_VH)  # type: ignore[attr-defined]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return export_drafter(model, Path(tempfile.mkdtemp()) / "export", dtype=torch.float32)


if __name__ == "__main__":
    main()
