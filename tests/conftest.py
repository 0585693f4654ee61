"""Shared test configuration: the `gpu` marker skips without CUDA; hangs dump every thread's stack;
generated caches shared by the whole session (``tiny_caches.py``)."""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny_caches import TinyCaches, shared_temp_dir

# A hang in a worker thread or subprocess must fail with stacks, not block CI (pytest-timeout
# enforces the limit; faulthandler shows where every thread was).
faulthandler.enable(file=sys.stderr, all_threads=True)

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # `make test` runs one pytest worker per core: torch's own threads on top would oversubscribe the
    # cores, and OpenMP threads waiting on a descheduled sibling turn a tiny matmul from µs into ms.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# The modules of the slow tests of over ~20 s, ordered by their longest test, longest first (`make test-slow
# --durations=60` on the shared 2-core machine, 2026-12-07: 62 s down to 8 s; test_target_compile.py by its
# run with inductor's cache empty, as on a fresh machine: 34 s, 12 s with it filled). `make test-slow` runs
# about sixty tests of a few seconds to a minute on two workers: one of these started last would run alone at
# the end while the other worker idles, so they start first and the short ones fill in around them. The two
# slow tests of test_gguf_weights.py share one GGUF load (a module fixture): pytest-xdist hands each worker a
# first chunk of two tests (--maxschedchunk 1), so with that module first both run on one worker and load it
# once.
LONGEST_FIRST = (
    "tests/target_model/test_gguf_weights.py",
    "tests/test_quality_harness.py",
    "tests/train/test_follow_kill.py",
    "tests/train/test_train_kill.py",
    "tests/generate/test_torchrun.py",
    "tests/generate/test_generate_kill.py",
    "tests/decode/test_target_compile.py",
    "tests/generate/test_generate_formats.py",
    "tests/train/test_train_torchrun.py",
    "tests/generate/test_window_bound.py",
    "tests/generate/test_faults.py",
    "tests/train/test_learnability.py",
    "tests/regenerate/test_workers.py",
    "tests/generate/test_generate_sigint.py",
    "tests/test_quality_follow.py",
    "tests/eval/test_train_eval_agreement.py",
    "tests/train/test_validation.py",
    "tests/train/test_follow.py",
    "tests/decode/test_drafter_compile.py",
    "tests/train/test_train_e2e.py",
    "tests/generate/test_generate_e2e.py",
    "tests/regenerate/test_partial.py",
    "tests/test_cli_faults.py",
    "tests/regenerate/test_regenerate_sigint.py",
    "tests/train/test_train_lock.py",
    "tests/train/test_train_spawn.py",
    "tests/drafter/test_compile.py",
    "tests/regenerate/test_answer_ids.py",
)


# Fast modules whose module-scoped set-ups take seconds (a training run, a compile, servers), put first in
# the collection. pytest-xdist hands each of the two workers a contiguous first chunk of an eighth of the
# collection (about 140 of `make test`'s tests), then smaller ones as they finish: a module inside the first
# chunk runs on one worker and sets up once, where one further down may be split and set up on both.
# Together they must stay well under that chunk (58 tests on 2026-12-07).
SET_UP_ONCE_FIRST = (
    "tests/decode/test_target_compile.py",
    "tests/train/test_follow_segments.py",
    "tests/train/test_follow_final_segment.py",
    "tests/regenerate/test_openai_engine.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.nodeid.partition("::")[0]
    if "slow" not in item.keywords:
        if path in SET_UP_ONCE_FIRST:  # before every other module
            return SET_UP_ONCE_FIRST.index(path) - len(SET_UP_ONCE_FIRST)
        return len(LONGEST_FIRST)
    if path not in LONGEST_FIRST:
        return len(LONGEST_FIRST)
    return LONGEST_FIRST.index(path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: the order within a module and among the rest is kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms() -> Iterator[None]:
    """An in-process ``train --deterministic`` turns torch's deterministic mode on for the process
    (it raises on kernels without a deterministic implementation): keep it from reaching other tests."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(scope="session")
def tiny_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyCaches]:
    """Generated random:tiny caches, one per shape for the session; never write into one."""
    caches = TinyCaches(shared_temp_dir(tmp_path_factory) / "tiny-caches")
    yield caches
    caches.assert_unchanged()


@pytest.fixture(scope="session")
def tiny_cache(tiny_caches: TinyCaches) -> Path:
    """The default shared cache: 80 chat records of every bucket, the default codec."""
    return tiny_caches.get(records=80, seed=5).root


@pytest.fixture(scope="session")
def uncompressed_cache(tiny_caches: TinyCaches) -> Path:
    """60 chat records stored without compression (a flipped byte stays one flipped feature): the
    training fault, kill and torchrun tests share it. A commit every MiB gives it several shard files on
    any machine (≈ 3 MB of features), so the fault tests always find a second chunk to damage."""
    return tiny_caches.get(records=60, seed=7, codec="none", flush_bytes=1 << 20).root
