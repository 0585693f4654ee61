"""Profile a real ``dflash`` command over a few calls of one of its methods (an optimizer step, a decode
step): torch.profiler with a schedule of ``skip`` calls, then ``active`` profiled ones, the command run
in this process with its own arguments. What ``bench/train_profile.py`` and ``bench/regenerate_profile.py``
share: how the method is wrapped, and the figures of a call (device kernel time against wall time, kernel
launches, compiled-graph calls, the largest kernels and host ops)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

COMPILED = ("CompiledFunction", "CompiledFunctionBackward")
SECONDS: dict[str, float] = {}
"""Wall seconds of the calls wrapped by ``timed``, by name."""
CALLS: dict[str, int] = {}
"""How many calls ``timed`` counted, by name."""
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding its wall time and calls under ``name`` to ``SECONDS`` and ``CALLS`` (nested names
    overlap: each is a total)."""

    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SECONDS[name] = SECONDS.get(name, 0.0) + time.perf_counter() - start
            CALLS[name] = CALLS.get(name, 0) + 1

    return wrapper


def summarize(prof: Any, active: int, wall_s: list[float]) -> dict[str, Any]:
    """The profile's figures a call (``wall_s``: the wall seconds of the profiled calls)."""
    events = prof.key_averages()
    # The kernels' own events only, as the table's "Self CUDA time total" counts them: an operator's row
    # also carries the self time of the kernels it launched, so a sum over every row counts them twice
    # (the first H200 profile with this sum gave a device busy 1.93 times the wall time).
    device_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    calls = {e.key: e.count for e in events}
    wall = sum(wall_s) / len(wall_s) if wall_s else None
    device_s = device_us / 1e6 / active if torch.cuda.is_available() else None
    return {
        "calls": active,
        "wall_s_per_call": wall,
        "device_kernel_s_per_call": device_s,
        "device_busy_fraction": device_s / wall if device_s is not None and wall else None,
        "launches_per_call": sum(calls.get(k, 0) for k in LAUNCHES) / active,
        "compiled_calls_per_call": sum(calls.get(k, 0) for k in COMPILED) / active,
        "dynamo_guard_us_per_call": next(
            (e.self_cpu_time_total / active for e in events if e.key == "TorchDynamo Cache Lookup"), 0.0
        ),
        "aten_ops_per_call": sum(e.count for e in events if e.key.startswith("aten::")) / active,
    }


def profile_command(
    owner: type, method: str, argv: list[str], *, skip: int, active: int, rows: int, out: Path | None
) -> None:
    """Run ``dflash *argv`` in this process with ``owner.method`` wrapped: its calls ``skip`` + 1 (warm-up)
    to ``skip`` + 1 + ``active`` are profiled, then the tables and figures are printed (and written to
    ``out`` as JSON)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    call_ends: list[float] = []

    def report(prof: Any) -> None:
        # Called when the active calls end, inside the command: the CLI may exit the process at its end
        # without returning here.
        walls = [b - a for a, b in zip(call_ends[-active - 1 :], call_ends[-active:])]
        figures = summarize(prof, active, walls)
        events = prof.key_averages()
        print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=55))
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=55))
        print(json.dumps(figures, indent=1), flush=True)
        if out is not None:
            out.write_text(json.dumps(figures, indent=1) + "\n")

    prof = profile(
        activities=activities,
        schedule=schedule(wait=skip, warmup=1, active=active, repeat=1),
        on_trace_ready=report,
    )
    original = getattr(owner, method)

    def profiled(self: Any, *a: Any, **k: Any) -> Any:
        result = original(self, *a, **k)
        # No sync: the host runs ahead as in a run, and is timed so. Appended before prof.step(), which
        # calls report() after the last profiled call: its end must be counted already.
        call_ends.append(time.perf_counter())
        prof.step()
        return result

    setattr(owner, method, profiled)
    from dflash_offline.cli import main as cli

    prof.start()
    try:
        cli.main(argv, standalone_mode=False)
    finally:
        prof.stop()
        setattr(owner, method, original)


def main(
    doc: str | None, owner: type, method: str, command: str, *, skip: int, active: int, what: str
) -> None:
    """The command line of a profile script: ``--skip``/``--active`` calls of ``owner.method`` (``what``,
    plural, names them in the help), ``--rows``, ``--json`` (default ``$OUT/<command>_profile.json`` when
    ``$OUT`` is set), then ``--`` and ``dflash <command>``'s own arguments."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", type=int, default=skip, help=f"{what} before the profile")
    ap.add_argument("--active", type=int, default=active, help=f"{what} profiled")
    ap.add_argument("--rows", type=int, default=20, help="rows of each table")
    ap.add_argument("--json", type=Path, default=None, help=f"default: $OUT/{command}_profile.json")
    ap.add_argument("command_args", nargs=argparse.REMAINDER, help=f"-- then dflash {command}'s arguments")
    args = ap.parse_args()
    command_args = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if not command_args:
        ap.error(f"give dflash {command}'s arguments after --")
    out = args.json
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / f"{command}_profile.json"
    profile_command(
        owner, method, [command, *command_args], skip=args.skip, active=args.active, rows=args.rows, out=out
    )
