"""Test-only entry points of spawned training ranks (a spawned process imports its entry by name): the real
rank entry with ``train_rank`` replaced, so that a test makes rank 1 fail with no hook in the package."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash_offline.errors import ConfigError
from dflash_offline.train import launch

FAULT_TEXT = "injected fault in rank 1"


def _rank_1_raises(error: BaseException) -> Callable[..., Any]:
    def train_rank(config: Any, info: Any, **_: Any) -> None:
        if info.rank == 1:
            raise error
        time.sleep(600)  # rank 0 is still training when rank 1 fails: the launcher must end it

    return train_rank


def rank_1_config_error(spec: Any, events: Any, stop: Any) -> None:
    launch.train_rank = _rank_1_raises(ConfigError(FAULT_TEXT))  # type: ignore[assignment]
    launch._rank_main(spec, events, stop)


def rank_1_bug(spec: Any, events: Any, stop: Any) -> None:
    launch.train_rank = _rank_1_raises(RuntimeError(FAULT_TEXT))  # type: ignore[assignment]
    launch._rank_main(spec, events, stop)
