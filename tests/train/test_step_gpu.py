"""On a GPU an optimizer step runs without a host sync: everything it computes (loss, accuracies,
gradient norm) stays on the device until read (``torch.cuda.set_sync_debug_mode("error")`` raises on
``.item()``, ``.tolist()``, ``nonzero`` or a blocking copy)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_offline.drafter.loss import loss_rows
from dflash_offline.placement import DistInfo
from dflash_offline.train.step import OptimizerStep
from tests.drafter.helpers import random_row, tiny_config, tiny_drafter

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_an_optimizer_step_makes_no_host_sync(autocast: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    config = tiny_config(block_size=16, head_dim=16)
    model = tiny_drafter(config, seed=0).to(device)
    rows = []
    for seed, lengths in enumerate(([300, 140, 60], [500])):
        row = random_row(lengths, seed=seed, pad=20, num_anchors=12)
        rows.append(
            replace(row, loss_rows_N=loss_rows(row.loss_mask_T, row.doc_ids_T, row.anchors_A, 16)).to(device)
        )
    params = model.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    step = OptimizerStep(
        model=model,
        ddp_model=model,
        params=params,
        optimizer=optimizer,
        drafter_config=config,
        info=DistInfo(rank=0, world_size=1, local_rank=device.index or 0, device=device, backend="none"),
        grad_clip=1.0,
        attention="auto",
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if autocast else None,
    )
    step(rows, [False, False])  # compiles flex_attention, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outcomes = [step(rows, [False, False]) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    totals, grad_norm = outcomes[-1].read()
    assert totals.num_blocks == sum(r.num_anchors for r in rows)
    assert grad_norm > 0
    assert not model.flex_fallback.failed
