"""Decode attention over each row's live keys alone (``attention.attend_live``: the flash kernel's
variable-length forward reading the slot cache in place).

On the CPU the kernel does not run; the layout it is handed (``grouped_layout`` and ``live_keys``) is
checked by running the kernel's documented semantics by hand (sequence i: its queries against keys
``cu_seqlens_k[i] .. cu_seqlens_k[i] + seqused_k[i] − 1``) against masked attention over the bucket. On a
GPU (``-m gpu``) the kernel itself against the masked math kernel, and the engine with it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_offline.decode.attention import attend_live, flash_reads_live_lengths, grouped_layout, live_keys
from dflash_offline.decode.engine import DecodeEngine, EngineSettings
from dflash_offline.target_model.loader import load_target
from tests.decode.test_engine import random_prompts, run_all


def varlen_by_hand(q_TGD: torch.Tensor, k_T1D: torch.Tensor, v_T1D: torch.Tensor, live) -> torch.Tensor:
    """What the variable-length kernel computes: one query row of G heads per sequence, over that
    sequence's first ``seqused_k`` keys (one K/V head), softmax scaled by 1/sqrt(D)."""
    out = torch.empty_like(q_TGD)
    d = q_TGD.shape[-1]
    for i in range(q_TGD.shape[0]):
        assert live.cu_seqlens_q[i + 1] - live.cu_seqlens_q[i] == 1
        start, used = int(live.cu_seqlens_k[i]), int(live.seqused_k[i])
        keys, values = k_T1D[start : start + used, 0], v_T1D[start : start + used, 0]
        weights = torch.softmax(q_TGD[i] @ keys.T / math.sqrt(d), dim=-1)
        out[i] = weights @ values
    return out


def masked_reference(q, k, v, counts):
    mask = (torch.arange(k.shape[2])[None, :] < counts[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("rows_from", ["view", "gathered"])
def test_the_kernels_layout_reads_each_rows_live_keys_and_nothing_past_them(rows_from: str) -> None:
    """Decode rows read the cache as a view of slots 0..N−1 (planes ``capacity`` apart); a gathered copy
    has planes of the bucket's length: both layouts give each row its own live keys, whatever lies past
    them (poisoned here with huge values that any read past the count would show)."""
    gen = torch.Generator().manual_seed(0)
    slots, hk, group, cap, lb, d = 6, 3, 3, 40, 32, 8
    keys = torch.randn((slots, hk, cap, d), generator=gen)
    values = torch.randn((slots, hk, cap, d), generator=gen)
    counts = torch.tensor([1, 7, 32, 19, 2])
    n = counts.shape[0]
    q = torch.randn((n, hk * group, 1, d), generator=gen)
    clean_k, clean_v = keys[:n, :, :lb].clone(), values[:n, :, :lb].clone()
    for row, c in enumerate(counts.tolist()):
        keys[row, :, c:] = 1e6
        values[row, :, c:] = -1e6
    if rows_from == "view":
        k, v, planes = keys[:n, :, :lb], values[:n, :, :lb], cap
    else:
        order = torch.arange(n)
        k, v, planes = keys[:, :, :lb].index_select(0, order), values[:, :, :lb].index_select(0, order), lb
    live = live_keys(counts, num_kv_heads=hk, positions_per_head=planes, max_keys=lb)
    q_TGD, k_T1D, v_T1D = grouped_layout(q, k, v)
    got = varlen_by_hand(q_TGD, k_T1D, v_T1D, live).view(n, hk * group, 1, d)
    torch.testing.assert_close(got, masked_reference(q, clean_k, clean_v, counts))
    assert live.seqused_k.dtype == live.cu_seqlens_k.dtype == torch.int32
    assert live.seqused_k.tolist() == [c for c in counts.tolist() for _ in range(hk)]


def test_the_cpu_keeps_the_masked_path() -> None:
    """The flash kernel needs CUDA in half precision: elsewhere asking for it changes nothing."""
    assert not flash_reads_live_lengths(
        torch.device("cpu"), torch.float32, num_heads=9, num_kv_heads=3, head_dim=64
    )
    cpu = load_target("random:tiny", device="cpu", dtype=torch.float32)
    settings = EngineSettings(
        num_slots=2, max_len=40, max_new_tokens=4, stop_ids=frozenset(), live_attention=True
    )
    assert not DecodeEngine(cpu.model, settings).cache.reads_live_lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "qwen3-8b"])
def test_on_cuda_the_kernel_equals_masked_attention_in_a_graph(
    hq: int, hk: int, d: int, dtype: torch.dtype
) -> None:
    """SmolLM2's and Qwen3-8B's head shapes, a decode view of the cache with NaN past every row's count
    (a read past it would show), captured in a CUDA graph and replayed with new counts."""
    device = torch.device("cuda")
    assert flash_reads_live_lengths(device, dtype, num_heads=hq, num_kv_heads=hk, head_dim=d)
    gen = torch.Generator(device=device).manual_seed(1)
    slots, cap, lb, n = 40, 1100, 1024, 32
    keys = torch.randn((slots, hk, cap, d), generator=gen, device=device, dtype=dtype)
    values = torch.randn((slots, hk, cap, d), generator=gen, device=device, dtype=dtype)
    q = torch.randn((n, hq, 1, d), generator=gen, device=device, dtype=dtype)
    counts = torch.randint(1, lb + 1, (n,), generator=gen, device=device)
    out = torch.empty((n, hq, 1, d), device=device, dtype=dtype)

    def step() -> None:
        live = live_keys(counts, num_kv_heads=hk, positions_per_head=cap, max_keys=lb)
        out.copy_(attend_live(q, keys[:n, :, :lb], values[:n, :, :lb], live))

    step()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(2):
        counts.copy_(torch.randint(1, lb + 1, (n,), generator=gen, device=device))
        clean_k, clean_v = keys[:n, :, :lb].float().clone(), values[:n, :, :lb].float().clone()
        past = torch.arange(cap, device=device)[None, :] >= counts[:, None]  # [n, cap]
        keys[:n].masked_fill_(past[:, None, :, None], float("nan"))
        values[:n].masked_fill_(past[:, None, :, None], float("nan"))
        graph.replay()
        want = masked_reference(q.float(), clean_k, clean_v, counts)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=f"trial {trial}")
        keys[:n] = torch.nan_to_num(keys[:n], nan=0.0)
        values[:n] = torch.nan_to_num(values[:n], nan=0.0)


@pytest.mark.gpu
def test_on_cuda_the_engine_with_live_attention_answers_as_with_the_mask() -> None:
    """bf16 on CUDA with CUDA graphs: the same prompts through the engine with each decode attention. The
    two kernels round differently, so a near-tie may part two answers; a wrong read (another row's keys,
    padding) would part nearly all of them."""
    target = load_target("random:tiny", device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts(12, seed=7, vocab=target.info.vocab_size)
    max_new = [16] * len(prompts)
    answers = {}
    for live in (False, True):
        settings = EngineSettings(
            num_slots=4, max_len=96, max_new_tokens=16, stop_ids=frozenset(), prefill_tokens=64,
            attend_granule=16, live_attention=live,
        )  # fmt: skip
        engine = DecodeEngine(target.model, settings)
        assert engine.cache.reads_live_lengths == live
        answers[live] = run_all(engine, prompts, max_new)
    same = sum(
        a == b
        for key in answers[False]
        for a, b in zip(answers[False][key].token_ids, answers[True][key].token_ids, strict=True)
    )
    assert same >= 0.9 * sum(max_new), same
