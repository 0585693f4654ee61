"""The decode engine (``dflash_offline.decode``) against transformers, side by side in one run on one GPU.

Sections (each skipped, with a note, once ``--budget-s`` is spent; every figure goes to ``--json`` as soon
as it exists):

1. check: on CUDA in float32 with CUDA graphs on, the engine's greedy answers (more prompts than slots,
   different answer lengths, chunked prefill) equal ``model.generate`` greedy, batch-1 target-only equals
   ``generate``, and the speculative loop equals target-only; whether cuDNN takes the sliced K/V.
2. regenerate throughput: new tok/s end to end (prefill, graph captures and host work included) of
   ``--engine slots`` (this engine, regenerate's only local one) and, as references
   (``bench/reference_engines.py``), ``static`` (left-padded ``generate`` batches) and ``cb``
   (transformers' continuous batching, CUDA graphs on) on the same ShareGPT first turns (<= 1,024 prompt
   tokens), one wave of ``batch`` prompts, a fixed answer length (random weights: no stop token), for
   ``random:smollm2-135m`` and ``random:qwen3-8b``; the engine alone again at 512 new tokens.
3. eval loops, batch 1 (SmolLM2 shape): target-only tok/s of the engine and of the HF reference loop, and the
   speculative cycle (untrained drafter, 5 layers, B = 16) as a multiple of one target decode step.
   ``long`` (not in the default list): only the 512-new-token runs of the SmolLM2 shape, the engine at
   batch 256 and 1,024 beside static ``generate`` batches at 256 (a run that follows another pipeline);
   ``ramp`` (not in the default list): the 1,024 × 512 run with the decode width at full while prompts
   wait against growing with the live rows, alternated, then once under the profiler (device and host
   time by op over the whole run).
4. ``random:qwen3-8b`` throughput (section 2's engines at batch 1/64/256).
   ``live`` (not in the default list): the engine with ``live_attention`` (decode steps attend over each
   row's live keys alone, the flash kernel) beside the default (over the step's bucket with a mask), at
   SmolLM2's shape (batch 256 and 1,024, 256 new tokens) and Qwen3-8B's (batch 64 and 256, 128 new); at
   SmolLM2's shape also the engine with its decoder layers through ``torch.compile`` (``--compile on``:
   its small elementwise kernels fused), warmed up (compiled) before it is timed. ``qwen3-live`` (not in
   the default list): Qwen3-8B's shape with the live attention at batch 256 and 512, 256 new tokens, and
   at batch 256, 512 new tokens.
5. kernel profile of one decode step (batch 256), transformers' (DynamicCache, sdpa) against the engine's.
   ``qwen3-profile`` (not in the default list): the same at Qwen3-8B's shape, the engine's step with the
   live attention.

    python bench/decode.py --data chat.jsonl --json out.json          # one H200 (about 4 minutes)
    python bench/decode.py --quick                                    # CPU smoke: tiny sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_turns import first_turns  # noqa: E402
from bench.reference_engines import ReferenceOptions, reference_engine  # noqa: E402
from dflash_offline.decode import DecodeEngine, EngineSettings, SingleSequence  # noqa: E402
from dflash_offline.decode.forward import DEFAULT_COMPILE_BACKEND  # noqa: E402
from dflash_offline.regenerate.engine_protocol import EngineOptions  # noqa: E402
from dflash_offline.regenerate.generation import GenerationSettings  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402
from dflash_offline.target_model.loader import load_target  # noqa: E402


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """Collects figures; rewrites the JSON after each one (a killed run keeps what it measured)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"check": {}, "throughput": [], "eval": {}, "profile": {}, "notes": []}

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2) + "\n")

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.data["notes"].append(text)
        self.save()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def drafter_layers(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({1, num_layers // 2, num_layers - 2})) if num_layers > 3 else (0, num_layers - 1)


def untrained_drafter(target: Any, layer_ids: tuple[int, ...], *, num_layers: int) -> Any:
    """A freshly initialised DFlash drafter (B = 16) over the target's embedding and head, in its dtype."""
    from dflash_offline.drafter import DFlashDrafter, DrafterConfig, resolve_mask_token_id

    info = target.info
    config = DrafterConfig.from_target_config(
        info.hf_config, target_layer_ids=layer_ids,
        mask_token_id=resolve_mask_token_id(target.tokenizer, info.vocab_size), num_layers=num_layers,
        block_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = target.model
    drafter = DFlashDrafter(
        config, embed_VH=model.get_input_embeddings().weight, lm_head_VH=model.get_output_embeddings().weight
    ).to(target.device)
    return drafter.cast_parameters(target.dtype).eval()


# ----- 1. check ---------------------------------------------------------------------------------------


@torch.inference_mode()
def check(report: Report, target_spec: str, prompts: list[list[int]], device: torch.device) -> None:
    from dflash_offline.decode.attention import attend

    target = load_target(target_spec, device=device, dtype=torch.float32)
    model = target.model
    news = [24, 9, 17, 3, 24, 12]
    chosen = [p[:200] for p in prompts[: len(news)]]
    engine = DecodeEngine(
        model,
        EngineSettings(
            num_slots=2, max_len=256, max_new_tokens=24, stop_ids=frozenset(), prefill_tokens=64,
            cuda_graphs=True, attend_granule=64,
        ),
    )  # fmt: skip
    for i, (p, n) in enumerate(zip(chosen, news, strict=True)):
        engine.submit(str(i), p, max_new_tokens=n)
    got: dict[str, tuple[int, ...]] = {}
    while engine.pending():
        got.update({d.key: d.token_ids for d in engine.poll(5.0)})
    same = 0
    for i, (p, n) in enumerate(zip(chosen, news, strict=True)):
        ids = torch.tensor([p], device=device)
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(p) :].tolist()  # fmt: skip
        same += list(got[str(i)]) == ref
    graphs = engine.graphs.num_captured
    engine.close()
    single = SingleSequence(model, max_len=320, attend_granule=64)
    layer_ids = drafter_layers(target.info.num_layers)
    drafter = untrained_drafter(target, layer_ids, num_layers=1)
    spec_same = only_same = 0
    for p in chosen[:3]:
        base = single.target_only(p, max_new_tokens=40, stop_ids=frozenset())
        spec = single.speculative(p, drafter, layer_ids=layer_ids, max_new_tokens=40, stop_ids=frozenset())
        ids = torch.tensor([p], device=device)
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(p) :].tolist()  # fmt: skip
        only_same += list(base.tokens) == ref
        spec_same += spec.tokens == base.tokens
    # cuDNN on a K/V slice (the attended length below the capacity): refused or taken?
    q = torch.randn(8, 9, 1, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(8, 3, 1024, 64, device=device, dtype=torch.bfloat16)
    mask = torch.ones(8, 1, 1, 256, dtype=torch.bool, device=device)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(
                q, kv[:, :, :256], kv[:, :, :256], attn_mask=mask, enable_gqa=True
            )
        cudnn_slice = "taken"
    except RuntimeError as e:
        cudnn_slice = f"refused: {str(e)[:120]}"
    ref_out = attend(q.float(), kv[:, :, :256].float(), kv[:, :, :256].float(), mask)
    err = (attend(q, kv[:, :, :256], kv[:, :, :256], mask).float() - ref_out).abs().max().item()
    report.data["check"] = {
        "target": target_spec,
        "dtype": "float32",
        "engine_equals_generate": f"{same}/{len(chosen)}",
        "engine_graphs_captured": graphs,
        "target_only_equals_generate": f"{only_same}/3",
        "speculative_equals_target_only": f"{spec_same}/3",
        "cudnn_on_sliced_kv": cudnn_slice,
        "bf16_attention_max_abs_error": round(err, 5),
    }
    report.save()
    print("check:", json.dumps(report.data["check"]), flush=True)
    del engine, single, model, target, drafter
    free_memory()


# ----- 2. throughput ----------------------------------------------------------------------------------


def run_engine(
    name: str, model: Any, prompts: list[list[int]], new: int, batch: int, limit_s: float, **extra: Any
) -> dict[str, Any]:
    settings = GenerationSettings(max_new_tokens=new, temperature=0.0, stop_ids=frozenset())
    longest = max(map(len, prompts))
    max_batch_tokens = extra.get("max_batch_tokens", 4096)
    free_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    engine: Any
    if name == "slots":
        options = EngineOptions(
            batch_size=batch, kv_tokens=None, max_batch_tokens=max_batch_tokens, max_prompt_tokens=longest,
            live_attention=extra.get("live_attention", False), compile_backend=extra.get("compile_backend"),
        )  # fmt: skip
        engine = SlotEngine(model, settings, options)
    else:
        reference = ReferenceOptions(
            batch_size=batch, kv_tokens=batch * (longest + new), max_batch_tokens=max_batch_tokens,
            cuda_graphs="on",
        )  # fmt: skip
        engine = reference_engine(name, model, settings, reference)
    if "attend_granule" in extra:
        inner = engine._engine  # type: ignore[attr-defined]
        inner.cache.attend_granule = extra["attend_granule"]
    setup = time.perf_counter() - t0
    done = 0
    tokens = 0
    timed_out = False
    start = time.perf_counter()
    try:
        for i, p in enumerate(prompts):
            engine.submit(str(i), p)
        while done < len(prompts):
            if time.perf_counter() - start > limit_s:
                timed_out = True
                break
            for f in engine.poll(timeout=0.5):
                done += 1
                tokens += len(f.tokens.token_ids)
        sync()
        seconds = time.perf_counter() - start
        stats = {}
        if name == "slots":  # read before close (which frees the cache and the graphs)
            inner = engine._engine  # type: ignore[attr-defined]
            stats = {
                "slots": engine.num_slots,  # type: ignore[attr-defined]
                "steps": inner.num_steps,
                "prefills": inner.num_prefills,
                "graphs": inner.graphs.num_captured,
                "reads_slices": inner.cache.reads_slices,
                "reads_live_lengths": inner.cache.reads_live_lengths,
                "compiled": inner.fwd.compiled,
            }
    finally:
        engine.close(abort=timed_out)
    row = {
        "engine": name,
        "batch": batch,
        "prompts": len(prompts),
        "mean_prompt_tokens": round(statistics.mean(map(len, prompts)), 1),
        "new_tokens_per_answer": new,
        "answered": done,
        "timed_out": timed_out,
        "new_tokens": tokens,
        "seconds": round(seconds, 3),
        "setup_seconds": round(setup, 3),
        "new_tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else 0.0,
    }
    row.update(stats)
    if "attend_granule" in extra:
        row["attend_granule"] = extra["attend_granule"]
    if torch.cuda.is_available():
        row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del engine
    free_memory()
    return row


def _engine_variant(variant: str) -> tuple[str, dict[str, Any]]:
    """The engine and its ``run_engine`` extras of a plan's variant name."""
    extras: dict[str, dict[str, Any]] = {
        "slots-full": {"attend_granule": 1 << 20},
        "slots-live": {"live_attention": True},
        "slots-compiled": {"compile_backend": DEFAULT_COMPILE_BACKEND},
    }
    if variant in extras:
        return "slots", extras[variant]
    return variant, {}


def throughput(
    report: Report,
    budget: Budget,
    target_spec: str,
    prompts: list[list[int]],
    plan: list[tuple[str, int, int]],
    limit_s: float,
) -> None:
    t0 = time.perf_counter()
    target = load_target(target_spec, device="cuda" if torch.cuda.is_available() else "cpu")
    report.note(f"{target_spec}: loaded in {time.perf_counter() - t0:.1f} s ({target.dtype})")
    # One untimed tiny run per engine first: library initialisation (cuBLAS, cuDNN plans, allocator
    # growth) is paid there, not by whichever engine happens to run first; and the compile of a compiled
    # engine (a prefill and a decode step of several rows: the shapes are dynamic, so batch 2 compiles
    # what the larger batches run).
    for variant in sorted({n.removesuffix("-full").removesuffix("-live") for n, _, _ in plan}):
        name, extra = _engine_variant(variant)
        try:
            run_engine(name, target.model, prompts[:4], 8, 2, 120, **extra)
        except Exception as e:
            report.note(f"warm-up of {variant} failed: {type(e).__name__}: {e}")
    for variant, batch, new in plan:
        if budget.left() < 20:
            report.note(f"skipped {target_spec} {variant} batch {batch} new {new}: budget")
            continue
        name, extra = _engine_variant(variant)
        try:
            row = run_engine(
                name, target.model, prompts[:batch], new, batch, min(limit_s, budget.left() - 10), **extra
            )
        except Exception as e:  # measure the rest
            row = {"engine": name, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["target"] = target_spec
        report.data["throughput"].append(row)
        report.save()
        print(json.dumps(row), flush=True)
    del target
    free_memory()


# ----- 3. eval loops ----------------------------------------------------------------------------------


@torch.inference_mode()
def eval_loops(report: Report, target_spec: str, prompts: list[list[int]], new: int) -> None:
    from tests.oracles.reference_decode import TargetCaller, target_only_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(target_spec, device=device)
    layer_ids = drafter_layers(target.info.num_layers)
    drafter = untrained_drafter(target, layer_ids, num_layers=5)
    model = target.model
    single = SingleSequence(model, max_len=1024 + new + 17)
    chosen = [p[:1000] for p in prompts[:3]]
    single.target_only(chosen[0], max_new_tokens=8, stop_ids=frozenset())  # warm-up (graphs of small buckets)
    only = [single.target_only(p, max_new_tokens=new, stop_ids=frozenset()) for p in chosen]
    spec = [
        single.speculative(p, drafter, layer_ids=layer_ids, max_new_tokens=new, stop_ids=frozenset())
        for p in chosen
    ]
    step_ms = sum(r.decode_seconds for r in only) / sum(r.num_target_forwards for r in only) * 1e3
    cycle_ms = sum(r.decode_seconds for r in spec) / sum(r.num_cycles for r in spec) * 1e3
    tok_s = sum(len(r.tokens) - 1 for r in only) / sum(r.decode_seconds for r in only)
    caller = TargetCaller(model)
    target_only_decode(caller, chosen[0], max_new_tokens=8, stop_ids=frozenset())
    old = target_only_decode(caller, chosen[0], max_new_tokens=min(new, 64), stop_ids=frozenset())
    old_tok_s = (len(old.tokens) - 1) / old.decode_seconds
    report.data["eval"] = {
        "target": target_spec,
        "new_tokens": new,
        "engine_target_only_tok_s": round(tok_s, 1),
        "engine_step_ms": round(step_ms, 3),
        "hf_loop_target_only_tok_s": round(old_tok_s, 1),
        "spec_cycle_ms": round(cycle_ms, 3),
        "spec_cycle_over_target_step": round(cycle_ms / step_ms, 3),
        "spec_identical_to_target_only": sum(s.tokens == o.tokens for s, o in zip(spec, only, strict=True)),
        "tau": round(statistics.mean(r.tau or 0 for r in spec), 3),
        "graphs": single.graphs.num_captured,
    }
    report.save()
    print("eval:", json.dumps(report.data["eval"]), flush=True)
    del single, drafter, model, target
    free_memory()


# ----- ramp: where a 1,024-row run's time goes ---------------------------------------------------------


def _grow_rows(engine: Any) -> int:
    """The decode width before the full-width ramp: the bucket covering the highest live slot."""
    from dflash_offline.decode.engine import row_bucket

    return row_bucket(max(engine._decoding) + 1, engine.settings.num_slots)


def ramp(
    report: Report, target_spec: str, prompts: list[list[int]], batch: int, new: int, limit_s: float
) -> None:
    """One wave of ``batch`` prompts (the 1,024 × 512 run that lost speed), three ways in one process: the
    engine as it is, with the decode width growing with the live rows instead of full width while prompts
    wait, and as it is under the profiler (the ops that take the device and host time of the whole run)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dflash_offline.decode.engine import DecodeEngine

    cuda = torch.cuda.is_available()
    target = load_target(target_spec, device="cuda" if cuda else "cpu")
    run_engine("slots", target.model, prompts[:2], 8, 2, 60)  # library initialisation, untimed
    full_width = DecodeEngine._decode_rows
    rows = []
    for rule in ("full-width", "grow", "full-width", "grow"):
        DecodeEngine._decode_rows = full_width if rule == "full-width" else _grow_rows  # type: ignore[method-assign]
        try:
            row = run_engine("slots", target.model, prompts[:batch], new, batch, limit_s)
        finally:
            DecodeEngine._decode_rows = full_width  # type: ignore[method-assign]
        row.update(target=target_spec, ramp_rule=rule)
        rows.append(row)
        print(json.dumps(row), flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        profiled = run_engine("slots", target.model, prompts[:batch], new, batch, limit_s)
    events = prof.key_averages()
    by_device = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=20)
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=20)
    report.data["ramp"] = {"runs": rows, "profiled_run": profiled, "by_device": by_device, "by_host": by_host}
    report.save()
    print(by_device)
    print(by_host, flush=True)
    del target
    free_memory()


# ----- 4. profile -------------------------------------------------------------------------------------


@torch.inference_mode()
def profile(
    report: Report,
    target_spec: str,
    batch: int,
    context: int,
    *,
    live_attention: bool = False,
    report_key: str = "profile",
) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dflash_offline.decode.sampling import Sampler, Sampling
    from dflash_offline.decode.steps import PrefillChunk, decode_step, prefill

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(target_spec, device=device)
    model = target.model
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ids = torch.randint(100, 40000, (batch, context), device=device)

    def table(prof: Any, steps: int) -> dict[str, Any]:
        events = prof.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / steps
        return {
            "kernel_ms_per_step": round(device_us / 1e3, 3),
            "table": events.table(sort_by=sort, row_limit=10, max_name_column_width=60),
        }

    from tests.oracles.reference_decode import TargetCaller

    kw = TargetCaller(model)._cache_kwarg
    cache = TargetCaller(model).new_cache()
    # The last position's logits alone: Qwen3-8B's over 256 × 512 positions would be 40 GB.
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(2):
        token = model(input_ids=token, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)
    sync()
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            token = model(input_ids=token, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)
        sync()
    old = table(prof, 3)
    del cache, out
    free_memory()
    engine = DecodeEngine(  # room for the 2 + 3 eager steps, the capture and the 10 replays below
        model,
        EngineSettings(
            num_slots=batch, max_len=context + 64, max_new_tokens=8, stop_ids=frozenset(),
            live_attention=live_attention,
        ),
    )  # fmt: skip
    sampler = Sampler(Sampling())
    rows = ids.tolist()
    for start in range(0, batch, 32):
        chunk = [
            PrefillChunk(slot=s, token_ids=tuple(rows[s]), start=0, completes=True, prompt_len=context)
            for s in range(start, min(batch, start + 32))
        ]
        prefill(engine.fwd, engine.state, sampler, chunk)
    lb = engine.cache.attend_len(context + 4)
    for _ in range(2):
        decode_step(engine.fwd, engine.state, sampler, batch, lb)
    sync()
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            decode_step(engine.fwd, engine.state, sampler, batch, lb)
        sync()
    new = table(prof, 3)
    # The same step replayed as a CUDA graph: wall time per step (what the engine runs).
    graph_ms = None
    if device.type == "cuda":
        fwd, state = engine.fwd, engine.state

        def step() -> None:
            decode_step(fwd, state, sampler, batch, lb)

        key = ("p", batch, lb)
        engine.graphs.run(key, step, engine.state.mutated())
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            engine.graphs.run(key, step, engine.state.mutated())
        sync()
        graph_ms = round((time.perf_counter() - t0) / 10 * 1e3, 3)
    engine.close()
    report.data[report_key] = {
        "target": target_spec, "batch": batch, "context": context, "live_attention": live_attention,
        "hf_eager": old, "engine_eager": new, "engine_graph_ms_per_step": graph_ms,
    }  # fmt: skip
    report.save()
    engine_name = "engine decode step" + (" (live attention)" if live_attention else "")
    for name, t in (("transformers (DynamicCache, sdpa)", old), (engine_name, new)):
        ms = t["kernel_ms_per_step"]
        where = f"{target_spec}: {name}, eager, batch {batch}, context {context}"
        print(f"== profile {where}: {ms} ms of kernels a step")
        print(t["table"])
    print(f"engine decode step as a CUDA graph: {graph_ms} ms a step", flush=True)
    free_memory()


# ----- summary ----------------------------------------------------------------------------------------


def summary(report: Report) -> None:
    print("\n== decode engine (new tok/s, end to end)")
    print(f"{'target':22s} {'engine':16s} {'batch':>5s} {'new':>4s} {'tok/s':>10s} {'s':>7s}")
    for r in report.data["throughput"]:
        if "error" in r:
            print(f"{r['target']:22s} {r['engine']:16s} {r['batch']:5d}  error: {r['error'][:60]}")
            continue
        name = (
            r["engine"]
            + ("-full" if "attend_granule" in r else "")
            + ("-live" if r.get("reads_live_lengths") else "")
            + ("-compiled" if r.get("compiled") else "")
        )
        flag = " (timed out)" if r["timed_out"] else ""
        print(
            f"{r['target']:22s} {name:16s} {r['batch']:5d} {r['new_tokens_per_answer']:4d} "
            f"{r['new_tokens_per_second']:10,.0f} {r['seconds']:7.2f}{flag}"
        )
    e = report.data["eval"]
    if e:
        print(
            f"eval batch 1: engine target-only {e['engine_target_only_tok_s']:.0f} tok/s "
            f"({e['engine_step_ms']:.2f} ms/step; HF loop {e['hf_loop_target_only_tok_s']:.0f}); "
            f"spec cycle {e['spec_cycle_ms']:.2f} ms = {e['spec_cycle_over_target_step']:.2f}x a target step"
        )
    p = report.data["profile"]
    if p:
        old_ms, new_ms = p["hf_eager"]["kernel_ms_per_step"], p["engine_eager"]["kernel_ms_per_step"]
        print(
            f"decode step batch {p['batch']}: kernels {old_ms} ms (transformers) vs {new_ms} ms (engine); "
            f"engine step as a graph {p['engine_graph_ms_per_step']} ms"
        )
    c = report.data["check"]
    if c:
        print("check:", json.dumps(c))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="chat data (default: the embedded ShareGPT file)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--limit-s", type=float, default=40.0, help="per engine run")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test at tiny sizes")
    ap.add_argument("--sections", default="check,smollm2,eval,qwen3,profile")
    args = ap.parse_args()
    budget = Budget(args.budget_s)
    report = Report(args.json)
    import transformers

    cuda = torch.cuda.is_available()
    report.data["env"] = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }  # fmt: skip
    print(json.dumps(report.data["env"]), flush=True)
    from dflash_offline.target_model.loader import load_tokenizer

    tokenizer = load_tokenizer("random:tiny")
    prompts = [
        turn.prompt_ids
        for turn in first_turns(
            tokenizer, args.data, max_prompt_tokens=1024, limit=16 if args.quick else 1100
        )
    ]
    lengths = [len(p) for p in prompts]
    report.note(f"{len(prompts)} prompts, mean {statistics.mean(lengths):.0f} tokens, max {max(lengths)}")
    sections = args.sections.split(",")
    small, big = ("random:tiny", "random:tiny") if args.quick else ("random:smollm2-135m", "random:qwen3-8b")
    device = torch.device("cuda" if cuda else "cpu")
    if "check" in sections:
        try:
            check(report, small, prompts, device)
        except Exception as e:
            report.note(f"check failed: {type(e).__name__}: {e}")
    if "smollm2" in sections:
        if args.quick:
            plan = [(e, b, 8) for b in (1, 4) for e in ("slots", "static", "cb")]
        else:
            plan = [(e, b, 128) for b in (1, 64, 256, 1024) for e in ("slots", "static", "cb")]
            plan = [p for p in plan if p != ("cb", 1024, 128)] + [
                ("slots", b, 512) for b in (1, 64, 256, 1024)
            ]
            plan.append(("slots-full", 256, 128))
        throughput(report, budget, small, prompts, plan, args.limit_s)
    if "long" in sections:
        plan = [("slots", 1024, 512), ("slots", 256, 512), ("static", 256, 512)]
        throughput(
            report,
            budget,
            small,
            prompts,
            [(e, 2, 8) for e, _, _ in plan] if args.quick else plan,
            args.limit_s,
        )
    if "ramp" in sections:
        try:
            ramp(report, small, prompts, 4 if args.quick else 1024, 8 if args.quick else 512, args.limit_s)
        except Exception as e:
            report.note(f"ramp failed: {type(e).__name__}: {e}")
    if "eval" in sections and budget.left() > 30:
        try:
            eval_loops(report, small, prompts, 16 if args.quick else 128)
        except Exception as e:
            report.note(f"eval failed: {type(e).__name__}: {e}")
    if "qwen3" in sections:
        plan = [("slots", b, 128) for b in (1, 64, 256)] + [("static", b, 128) for b in (64, 256)]
        plan.append(("cb", 64, 128))
        if args.quick:
            plan = [("slots", 2, 8), ("static", 2, 8)]
        throughput(report, budget, big, prompts, plan, args.limit_s)
    if "qwen3-live" in sections:
        # Qwen3-8B's shape with the live attention at regenerate's answer length, at batch 256 and 512 (the
        # KV cache of 512 slots of 1,281 positions: ≈ 97 GB beside the 16 GB of weights).
        # Batch 256 at 512 new tokens too (the longest answers: prefill a smaller share of tokens).
        plan = [("slots-live", 2, 8)] if args.quick else [("slots-live", b, 256) for b in (256, 512)]
        plan += [] if args.quick else [("slots-live", 256, 512)]
        throughput(report, budget, big, prompts, plan, args.limit_s)
    if "qwen3-profile" in sections and budget.left() > 60:
        # Where the 8B model's live decode step goes (kernels by op), beside transformers' step.
        try:
            profile(report, big, 4 if args.quick else 256, 64 if args.quick else 512, live_attention=True,
                    report_key="profile-qwen3")  # fmt: skip
        except Exception as e:
            report.note(f"qwen3 profile failed: {type(e).__name__}: {e}")
    if "live" in sections:
        # The decode steps' attention over each row's live keys (the flash kernel) against over the step's
        # bucket with a mask, alternated at each shape; SmolLM2's at 256 new tokens (regenerate's answers).
        pairs = [(small, 256, 256), (small, 1024, 256), (big, 64, 128), (big, 256, 128)]
        if args.quick:
            pairs = [(small, 2, 8)]
        for spec in dict.fromkeys(t for t, _, _ in pairs):
            # Compiling fuses the small model's elementwise kernels; the 8B model's step is its matmuls.
            variants = ("slots", "slots-live") + (("slots-compiled",) if spec == small else ())
            plan = [(e, b, n) for t, b, n in pairs if t == spec for e in variants]
            throughput(report, budget, spec, prompts, plan, args.limit_s)
    if "profile" in sections and budget.left() > 30:
        try:
            profile(report, small, 8 if args.quick else 256, 64 if args.quick else 512)
        except Exception as e:
            report.note(f"profile failed: {type(e).__name__}: {e}")
    summary(report)


if __name__ == "__main__":
    main()
