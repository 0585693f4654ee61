"""The DFlash drafter (docs/drafter.md): model, training attention mask, anchors, loss, export.

Public API:
  config.DrafterConfig            shape copied from the target + DFlash fields
  batch.DrafterInputs             one packed row of documents with its anchors (pack_documents builds it)
  anchors.sample_anchors          per-document anchors, uniform without replacement
  model.DFlashDrafter             forward_train → DrafterOutput; draft / draft_logits for eval
  loss.decayed_cross_entropy      reference loss; position_accuracy, simulated_acceptance_length
  export.export_drafter / load_exported_drafter   z-lab DFlash directory layout
  mask_token.resolve_mask_token_id
"""

from dflash_offline.drafter.anchors import sample_anchors
from dflash_offline.drafter.batch import DocumentTensors, DrafterInputs, pack_documents
from dflash_offline.drafter.config import DrafterConfig, default_loss_gamma
from dflash_offline.drafter.export import export_drafter, load_exported_drafter
from dflash_offline.drafter.loss import (
    decayed_cross_entropy,
    position_accuracy,
    simulated_acceptance_length,
)
from dflash_offline.drafter.mask_token import resolve_mask_token_id
from dflash_offline.drafter.model import ContextCache, DFlashDrafter, DrafterOutput

__all__ = [
    "ContextCache",
    "DFlashDrafter",
    "DocumentTensors",
    "DrafterConfig",
    "DrafterInputs",
    "DrafterOutput",
    "decayed_cross_entropy",
    "default_loss_gamma",
    "export_drafter",
    "load_exported_drafter",
    "pack_documents",
    "position_accuracy",
    "resolve_mask_token_id",
    "sample_anchors",
    "simulated_acceptance_length",
]
