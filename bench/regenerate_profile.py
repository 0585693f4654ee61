"""Where a ``dflash regenerate`` run's wall time goes: the real command (one worker, in this process: the
decode engine, its prefill forwards and CUDA graphs, the writer), with torch.profiler over ``--active``
engine steps after ``--skip`` (start-up, graph captures and the ramp left out), and the driver's host work
between the steps timed over the whole run.

A step is one decode step of every decoding slot and at most one prefill forward built while the device
runs it, launched and then read back (``DecodeEngine._launch``, ``_collect``). Prints the device kernel
time a step against the wall time from one step's read-back to the next (the device's busy fraction), the
kernel launches a step, and the largest kernels and host ops. At the end (a SIGINT included: regenerate
stops cleanly) the driver's seconds: inside the engine's steps (``poll``), rendering and tokenizing
prompts (``render_prompt_s``: ``PromptEncoder.encode``, a turn continuing its previous turn's ids), taking
finished answers (``Driver._answered``:
decoding, the next turn's prompt, writing), admitting records (``Driver._admit``: its first turn's
prompt), writing conversations, and the rest (reading and parsing the records, the loop). On one H200 a
quarter of the generation time was outside the steps (bench/RESULTS.md, "Regenerate's engine step").
Everything after ``--`` is ``dflash regenerate``'s own arguments (one worker: ``--gpus 0``
or the CPU):

    python bench/regenerate_profile.py --skip 300 --active 20 -- --target default --data PROMPTS \\
      --limit 3000 --max-new-tokens 256 --max-prompt-tokens 1536 --batch-size 1024 --max-batch-tokens 8192 \\
      --gpus 0 --no-progress --out /tmp/profile-answers.jsonl

Runs on the CPU too (no device kernels there: the host-op table alone). The driver's seconds go to
``$OUT/regenerate_driver.json`` (or ``--driver-json``).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import profiling  # noqa: E402
from bench.profiling import CALLS, SECONDS, timed  # noqa: E402
from dflash_offline.decode.engine import DecodeEngine  # noqa: E402
from dflash_offline.regenerate import driver as driver_module  # noqa: E402
from dflash_offline.regenerate.prompt_ids import PromptEncoder  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402


def time_the_driver() -> None:
    """Wrap the driver's parts (class attributes, so the driver's own calls go through the wrappers)."""
    PromptEncoder.encode = timed("render_prompt", PromptEncoder.encode)  # type: ignore[method-assign]
    Driver, Sink = driver_module.Driver, driver_module.ConversationSink
    Driver.run = timed("driver_run", Driver.run)  # type: ignore[method-assign]
    Driver._answered = timed("answered", Driver._answered)  # type: ignore[method-assign]
    Driver._admit = timed("admit", Driver._admit)  # type: ignore[method-assign]
    Sink.write = timed("write", Sink.write)  # type: ignore[method-assign]
    SlotEngine.poll = timed("engine_poll", SlotEngine.poll)  # type: ignore[method-assign]


def driver_report(out: Path | None) -> None:
    if "driver_run" not in SECONDS:
        return
    total, steps = SECONDS["driver_run"], SECONDS.get("engine_poll", 0.0)
    outside = total - steps
    taken = SECONDS.get("answered", 0.0) + SECONDS.get("admit", 0.0)
    figures = {
        "driver_run_s": total,
        "in_engine_steps_s": steps,
        "outside_steps_s": outside,
        "outside_share": outside / total if total else None,
        "render_prompt_s": SECONDS.get("render_prompt", 0.0),
        "render_prompt_calls": CALLS.get("render_prompt", 0),
        "answered_s": SECONDS.get("answered", 0.0),
        "answered_calls": CALLS.get("answered", 0),
        "admit_s": SECONDS.get("admit", 0.0),
        "admit_calls": CALLS.get("admit", 0),
        "write_s": SECONDS.get("write", 0.0),
        "records_and_loop_s": outside - taken,
    }
    print(json.dumps({"driver": figures}, indent=1), flush=True)
    if out is not None:
        out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    driver_json = None
    if "--driver-json" in sys.argv[: sys.argv.index("--") if "--" in sys.argv else len(sys.argv)]:
        i = sys.argv.index("--driver-json")
        driver_json = Path(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    elif os.environ.get("OUT"):
        driver_json = Path(os.environ["OUT"]) / "regenerate_driver.json"
    time_the_driver()
    atexit.register(driver_report, driver_json)
    # One call a step: ``poll`` runs its steps as ``_launch`` then ``_collect`` (an engine before that
    # split ran ``step``); the time between two calls' ends is a step's period, the caller's work included.
    method = "_collect" if hasattr(DecodeEngine, "_collect") else "step"
    profiling.main(__doc__, DecodeEngine, method, "regenerate", skip=300, active=20, what="engine steps")
