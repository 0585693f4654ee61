"""Attention over each row's live keys alone (``attention.attend_live``: the flash kernel's variable-length
forward reading the slot cache in place), for decode steps and prefills over the cache.

On the CPU the kernel does not run; the layout it is handed (``grouped_layout``, ``live_keys``) is run by
hand with the kernel's documented semantics (sequence i: its S queries against the keys from
``cu_seqlens_k[i]``, ``seqused_k[i]`` of them, causal aligned to their end) and compared with a brute-force
loop over rows, heads and queries; the same stand-in then runs inside the engine (decode steps, chunked
prompts, continuations of a parked slot), whose answers must equal ``generate``'s. On a GPU (``-m gpu``) the
kernel itself against the masked math kernel, and the engine with it."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dflash_offline.decode import slot_cache as slot_cache_module
from dflash_offline.decode.attention import (
    LiveKeys,
    attend_live,
    flash_reads_live_lengths,
    grouped_layout,
    live_keys,
    masked_live_reference,
)
from dflash_offline.decode.engine import DecodeEngine, EngineSettings
from dflash_offline.decode.slot_cache import LiveAttentionWarning
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.decode.test_engine import generate_greedy, random_prompts, run_all
from tests.decode.test_parked_slots import RULES, converse


def varlen_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live: LiveKeys) -> torch.Tensor:
    """What the variable-length kernel computes from its inputs ([T·S, G, D] queries, [positions, 1, D]
    keys and values): sequence i's query s over keys ``cu_seqlens_k[i] + j`` for j < used − S + s + 1
    (all ``used`` of them when S = 1), softmax scaled by 1/sqrt(D)."""
    s, d = live.queries, q.shape[-1]
    t = live.seqused_k.shape[0]
    assert torch.equal(live.cu_seqlens_q, torch.arange(t + 1, dtype=torch.int32) * s)
    j_K = torch.arange(live.max_keys)
    idx_TK = (live.cu_seqlens_k[:t, None].long() + j_K[None, :]).clamp(max=k.shape[0] - 1)
    keys_TKD, values_TKD = k[idx_TK, 0], v[idx_TK, 0]
    q_TSGD = q.view(t, s, q.shape[1], d)
    scores = torch.einsum("tsgd,tkd->tsgk", q_TSGD, keys_TKD) / math.sqrt(d)
    last_TS = live.seqused_k[:, None].long() - s + torch.arange(s)[None, :]
    seen = j_K[None, None, :] <= last_TS[:, :, None]  # [T, S, K]
    scores = scores.masked_fill(~seen[:, :, None, :], float("-inf"))
    out = torch.einsum("tsgk,tkd->tsgd", torch.softmax(scores, dim=-1), values_TKD)
    return out.reshape(t * s, q.shape[1], d)


def brute_force(q_NHSD, k_cache, v_cache, slots, counts) -> torch.Tensor:
    """[N, S, Hq, D], one row, head and query at a time: query s of row n sees positions 0..count−S+s of
    its slot at K/V head j // G."""
    n, hq, s, d = q_NHSD.shape
    group = hq // k_cache.shape[1]
    out = torch.empty((n, s, hq, d))
    for r in range(n):
        for j in range(hq):
            for i in range(s):
                last = int(counts[r]) - s + i
                keys = k_cache[int(slots[r]), j // group, : last + 1]
                values = v_cache[int(slots[r]), j // group, : last + 1]
                out[r, i, j] = torch.softmax(keys @ q_NHSD[r, j, i] / math.sqrt(d), dim=0) @ values
    return out


def emulated_attend_live(q_NHSD, k_cache, v_cache, live, *, scale=None) -> torch.Tensor:
    """``attend_live`` with the kernel run by hand (float32 on the CPU)."""
    assert scale is None or abs(scale - q_NHSD.shape[-1] ** -0.5) < 1e-9, scale
    n, hq, s, d = q_NHSD.shape
    hk = k_cache.shape[1]
    q, k, v = grouped_layout(q_NHSD, k_cache, v_cache)
    out = varlen_by_hand(q, k, v, live)
    return out.view(n, hk, s, hq // hk, d).transpose(1, 2).reshape(n, s, hq, d)


@pytest.mark.parametrize("queries", [1, 5])
def test_the_kernels_layout_reads_each_rows_live_keys_and_nothing_past_them(queries: int) -> None:
    """Rows reading slots out of order, one query a row (decode) or a causal block of 5 (a prefill chunk
    over the cache): the layout gives each row its own slot's keys up to its count, whatever lies past them
    (poisoned with huge values) and in the slots no row reads; the masked reference the GPU probe
    compares with agrees."""
    gen = torch.Generator().manual_seed(0)
    slots, hk, group, cap, d = 6, 3, 3, 40, 8
    keys = torch.randn((slots, hk, cap, d), generator=gen)
    values = torch.randn((slots, hk, cap, d), generator=gen)
    rows = torch.tensor([4, 0, 2, 5, 1])
    counts = torch.tensor([5, 7, 39, 19, 6])
    q = torch.randn((rows.shape[0], hk * group, queries, d), generator=gen)
    want = brute_force(q, keys, values, rows, counts)
    torch.testing.assert_close(masked_live_reference(q, keys, values, rows, counts), want)
    for r, c in zip(rows.tolist(), counts.tolist(), strict=True):
        keys[r, :, c:] = 1e6
        values[r, :, c:] = -1e6
    keys[3], values[3] = 1e6, -1e6  # read by no row
    live = live_keys(rows, counts, queries=queries, num_kv_heads=hk, capacity=cap)
    torch.testing.assert_close(emulated_attend_live(q, keys, values, live), want)
    assert live.seqused_k.dtype == live.cu_seqlens_k.dtype == live.cu_seqlens_q.dtype == torch.int32
    assert live.seqused_k.tolist() == [c for c in counts.tolist() for _ in range(hk)]


def test_the_cpu_keeps_the_masked_path() -> None:
    """The flash kernel needs CUDA in half precision: elsewhere asking for it changes nothing (a warning
    says so)."""
    assert not flash_reads_live_lengths(
        torch.device("cpu"), torch.float32, num_heads=9, num_kv_heads=3, head_dim=64
    )
    cpu = load_target("random:tiny", device="cpu", dtype=torch.float32)
    settings = EngineSettings(
        num_slots=2, max_len=40, max_new_tokens=4, stop_ids=frozenset(), live_attention=True
    )
    with pytest.warns(LiveAttentionWarning, match=r"does not run here \(cpu, torch.float32\)"):
        engine = DecodeEngine(cpu.model, settings)
    assert not engine.cache.reads_live_lengths


@pytest.fixture
def kernel_by_hand(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """The engine's live path on the CPU, the kernel run by hand; counts the calls by queries a row."""
    calls: Counter[int] = Counter()

    def counted(q_NHSD, k_cache, v_cache, live, *, scale=None) -> torch.Tensor:
        calls[q_NHSD.shape[2]] += 1
        return emulated_attend_live(q_NHSD, k_cache, v_cache, live, scale=scale)

    monkeypatch.setattr(slot_cache_module, "attend_live", counted)
    monkeypatch.setattr(slot_cache_module, "flash_reads_live_lengths", lambda *a, **k: True)
    return calls


@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager", "static"])
def test_the_engine_over_live_keys_equals_generate(
    target: LoadedTarget, kernel_by_hand: Counter[int], prefill_graphs: bool
) -> None:
    """9 prompts of 3–59 tokens through 3 slots in prefill chunks of 16 tokens (padding included: a
    prompt's later chunks read its slot in place), 5–14 new tokens each: every decode step and every chunk
    over the cache on the live path; with ``prefill_graphs`` the chunks over the cache run through the
    static-shape forward too (a CUDA graph per shape on a GPU)."""
    model = target.model
    prompts = random_prompts(9, seed=1, vocab=target.info.vocab_size)
    max_new = [5 + (i * 4) % 10 for i in range(len(prompts))]
    settings = EngineSettings(
        num_slots=3, max_len=80, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=16, attend_granule=8,
        live_attention=True, prefill_graphs=prefill_graphs,
    )  # fmt: skip
    engine = DecodeEngine(model, settings)
    assert engine.cache.reads_live_lengths
    got = run_all(engine, prompts, max_new)
    over_cache = {key for key in engine._static_buffers if key[2]}
    assert bool(over_cache) == prefill_graphs
    layers = model.config.num_hidden_layers
    assert kernel_by_hand[1] == layers * sum(engine.decode_shapes.values())  # every decode step
    assert kernel_by_hand.total() > kernel_by_hand[1]  # and chunks over the cache
    for i, p in enumerate(prompts):
        assert list(got[f"p{i}"].token_ids) == generate_greedy(model, p, max_new[i], frozenset()), i


@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("rule", RULES[:2], ids=lambda r: r.__name__)
def test_continuations_of_a_parked_slot_over_live_keys_equal_generate(
    target: LoadedTarget, kernel_by_hand: Counter[int], rule, prefill_graphs: bool
) -> None:
    """5 conversations of 3 turns through 3 slots, each later turn prefilling only what it adds over the
    keys its previous turn left in its slot, read in place."""
    model = target.model
    firsts = random_prompts(5, seed=4, vocab=target.info.vocab_size, lengths=(4, 30))

    def max_new(c: int, k: int) -> int:
        return 3 + (c + 2 * k) % 6

    settings = EngineSettings(
        num_slots=3, max_len=160, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=16, attend_granule=8,
        live_attention=True, prefill_graphs=prefill_graphs,
    )  # fmt: skip
    engine = DecodeEngine(model, settings)
    run = converse(engine, firsts, turns=3, rule=rule, reuse=True, max_new=max_new)
    assert engine.num_reused_tokens > 0
    assert any(key[2] for key in engine._static_buffers) == prefill_graphs
    assert kernel_by_hand.total() > kernel_by_hand[1]
    for (c, k), prompt in run.prompts.items():
        assert run.answers[c, k] == generate_greedy(model, prompt, max_new(c, k), frozenset()), (c, k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("queries", [1, 16])
@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "qwen3-8b"])
def test_on_cuda_the_kernel_equals_masked_attention_in_a_graph(
    hq: int, hk: int, d: int, queries: int, dtype: torch.dtype
) -> None:
    """SmolLM2's and Qwen3-8B's head shapes, rows reading slots out of order with NaN past every row's
    count (a read past it would show), one query a row and causal blocks of 16, captured in a CUDA graph
    and replayed with new counts and slots."""
    device = torch.device("cuda")
    assert flash_reads_live_lengths(device, dtype, num_heads=hq, num_kv_heads=hk, head_dim=d)
    gen = torch.Generator(device=device).manual_seed(1)
    slots, cap, n = 40, 1100, 32
    keys = torch.randn((slots, hk, cap, d), generator=gen, device=device, dtype=dtype)
    values = torch.randn((slots, hk, cap, d), generator=gen, device=device, dtype=dtype)
    q = torch.randn((n, hq, queries, d), generator=gen, device=device, dtype=dtype)
    rows = torch.randperm(slots, generator=gen, device=device)[:n]
    counts = torch.randint(queries, cap, (n,), generator=gen, device=device)
    out = torch.empty((n, queries, hq, d), device=device, dtype=dtype)

    def step() -> None:
        live = live_keys(rows, counts, queries=queries, num_kv_heads=hk, capacity=cap)
        out.copy_(attend_live(q, keys, values, live))

    step()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(2):
        rows.copy_(torch.randperm(slots, generator=gen, device=device)[:n])
        counts.copy_(torch.randint(queries, cap, (n,), generator=gen, device=device))
        clean_k, clean_v = keys.float(), values.float()
        past = torch.arange(cap, device=device)[None, :] >= counts[:, None]  # [n, cap]
        keys[rows] = keys[rows].masked_fill(past[:, None, :, None], float("nan"))
        values[rows] = values[rows].masked_fill(past[:, None, :, None], float("nan"))
        graph.replay()
        want = masked_live_reference(q.float(), clean_k, clean_v, rows, counts)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=f"trial {trial}")
        keys.copy_(clean_k)
        values.copy_(clean_v)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager", "static"])
def test_on_cuda_the_engine_with_live_attention_answers_as_with_the_mask(prefill_graphs: bool) -> None:
    """bf16 on CUDA with CUDA graphs: the same prompts through the engine with each attention (prompts
    longer than a 32-token chunk continue over the cache; with ``prefill_graphs`` the live engine runs
    those chunks as CUDA graphs too). The two kernels round differently, so a near-tie may part two
    answers; a wrong read (another row's keys, padding) would part nearly all of them."""
    target = load_target("random:tiny", device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts(12, seed=7, vocab=target.info.vocab_size)
    max_new = [16] * len(prompts)
    answers = {}
    for live in (False, True):
        settings = EngineSettings(
            num_slots=4, max_len=96, max_new_tokens=16, stop_ids=frozenset(), prefill_tokens=32,
            attend_granule=16, live_attention=live, prefill_graphs=live and prefill_graphs,
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
