"""No command-line option is added, renamed or removed unnoticed: every command's options are checked
against the list in tests/cli/cli_options.txt (as torchtitan's ``test_no_new_cli_options.py`` does)."""

from __future__ import annotations

import pytest

from tests.cli._cli_options import UPDATE, changes, current_options, frozen_options


def test_every_command_has_the_options_of_the_frozen_list() -> None:
    message = changes(frozen_options(), current_options())
    if message is not None:
        pytest.fail(message, pytrace=False)


def test_an_added_and_a_removed_option_are_named_in_one_line() -> None:
    frozen = ["train --lr", "train --seed", "eval <CACHE>"]
    current = ["train --lr", "train --learning-rate", "eval <CACHE>"]
    message = changes(frozen, current)
    assert message is not None
    assert "\n" not in message
    assert message.startswith(
        "option added: dflash train --learning-rate; option removed: dflash train --seed. "
    )
    assert UPDATE in message
    assert changes(frozen, list(reversed(frozen))) is None


def test_the_frozen_list_is_sorted_and_names_real_commands() -> None:
    frozen = frozen_options()
    assert frozen == sorted(set(frozen)), "one line per option, sorted: regenerate it with " + UPDATE
    commands = {line.split(" ")[0] for line in frozen}
    assert {"generate", "regenerate", "train", "export", "eval"} <= commands
    assert "train --tokens-per-microbatch" in frozen
