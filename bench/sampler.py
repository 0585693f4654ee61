"""The decode engine's sampler (``decode/sampling.py``) against the Gumbel-max sampler it replaced, side by
side on the same logits: milliseconds a call, greedy argmax as the floor, and the ratio.

The logits are [rows, vocab] bf16 like a decode step's (a real step's vary; here a fixed random spread with a
few large entries, so the nucleus is small as in chat answers), sampled at temperature / top-p with the
regenerate defaults of the sampled answers. Each sampler runs ``--repeats`` times after a warm-up,
alternated; on CUDA it is timed with events after a synchronise. Both draw from the same distribution, not
the same tokens, so the script also prints how often each picked a token outside the nucleus (must be 0).

    python bench/sampler.py --rows 1024 --vocab 49152 --device cuda
    python bench/sampler.py --rows 256 --vocab 49152 --device cpu --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_offline.decode.sampling import Sampler, Sampling, request_key_hash
from dflash_offline.target_model.presets import mix32

_MASK32 = 0xFFFFFFFF


def gumbel_sampler(sampling: Sampling) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The replaced sampler, for the ratio: argmax(logits / T + Gumbel noise hashed per vocabulary entry),
    the tokens outside the nucleus set to −inf first."""

    def noise(seed: int, keys_N2: Tensor, steps_N: Tensor, vocab: int) -> Tensor:
        row_N = mix32(mix32(keys_N2[:, 0] ^ (seed & _MASK32)) ^ keys_N2[:, 1])
        row_N = mix32(row_N ^ (steps_N & _MASK32))
        ids_V = torch.arange(vocab, dtype=torch.int64, device=keys_N2.device)
        h_NV = mix32(mix32(ids_V[None, :] ^ row_N[:, None]) ^ ((seed >> 32) & _MASK32))
        return ((h_NV >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))

    def sample(logits_NV: Tensor, keys_N2: Tensor, steps_N: Tensor) -> Tensor:
        scaled_NV = logits_NV.float() / sampling.temperature
        if sampling.top_p < 1:
            sorted_NV, order_NV = scaled_NV.sort(dim=-1, descending=True)
            probs_NV = sorted_NV.softmax(dim=-1)
            outside_NV = probs_NV.cumsum(dim=-1) - probs_NV >= sampling.top_p
            sorted_NV = sorted_NV.masked_fill(outside_NV, float("-inf"))
            scaled_NV = torch.empty_like(scaled_NV).scatter_(-1, order_NV, sorted_NV)
        u_NV = noise(sampling.seed, keys_N2, steps_N, scaled_NV.shape[-1])
        return (scaled_NV - torch.log(-torch.log(u_NV))).argmax(dim=-1)

    return sample


def outside_nucleus(logits_NV: Tensor, tokens_N: Tensor, sampling: Sampling) -> int:
    """How many rows' tokens lie outside their nucleus (float64 brute force)."""
    probs_NV = (logits_NV.double() / sampling.temperature).softmax(dim=-1)
    mine_N = probs_NV.gather(-1, tokens_N[:, None])[:, 0]
    before_N = torch.where(probs_NV > mine_N[:, None], probs_NV, 0).sum(dim=-1)  # mass strictly above it
    return int((before_N >= sampling.top_p + 1e-6).sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 2
    logits[:, :8] += 12 * torch.rand(args.rows, 8, generator=gen)  # a few likely tokens, as in chat answers
    logits = logits.to(torch.bfloat16).to(device)
    keys = torch.tensor(
        [request_key_hash(f"r{i}") for i in range(args.rows)], dtype=torch.int64, device=device
    )
    steps = torch.arange(args.rows, dtype=torch.int64, device=device) % 256
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=1)
    samplers = {
        "greedy argmax": Sampler(Sampling()),
        "Gumbel-max (replaced)": gumbel_sampler(sampling),
        "inverse CDF (now)": Sampler(sampling),
    }

    def once(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> tuple[float, Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(logits, keys, steps)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn(logits, keys, steps)
        return (time.perf_counter() - t0) * 1e3, out

    times: dict[str, list[float]] = {name: [] for name in samplers}
    outputs: dict[str, Tensor] = {}
    for fn in samplers.values():
        once(fn)  # warm-up
    for _ in range(args.repeats):
        for name, fn in samplers.items():
            ms, outputs[name] = once(fn)
            times[name].append(ms)
    print(f"{args.rows} rows x {args.vocab} vocabulary, {device}, temperature {args.temperature}, "
          f"top-p {args.top_p}, median of {args.repeats}")  # fmt: skip
    print("| sampler | ms a call | × the replaced | tokens outside the nucleus |")
    print("|---|---|---|---|")
    base = statistics.median(times["Gumbel-max (replaced)"])
    for name, ms in times.items():
        med = statistics.median(ms)
        outside = "" if name == "greedy argmax" else str(outside_nucleus(logits, outputs[name], sampling))
        print(f"| {name} | {med:.2f} | {base / med:.2f} | {outside} |")


if __name__ == "__main__":
    main()
