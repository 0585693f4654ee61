"""The ``dflash`` command line: one small module per command, each building a typed config and calling
one library function. Commands are imported lazily so that ``dflash --help`` does not import torch."""

from __future__ import annotations

import errno
import importlib
import sys
from typing import Any

import click

from dflash_offline.cli.flags import FlagsOnStream, render
from dflash_offline.errors import DflashError, NoSpaceError, find_no_space

# command name -> "module:attribute" of its click command, in the order --help lists them.
COMMANDS: dict[str, str] = {
    "generate": "dflash_offline.cli.generate:generate",
    "regenerate": "dflash_offline.cli.regenerate:regenerate",
    "train": "dflash_offline.cli.train:train",
    "export": "dflash_offline.cli.export:export",
    "eval": "dflash_offline.cli.eval:eval_cmd",
    "index": "dflash_offline.cli.index:index",
    "sql": "dflash_offline.cli.sql:sql",
    "status": "dflash_offline.cli.status:status",
    "verify": "dflash_offline.cli.verify:verify",
    "plot": "dflash_offline.cli.plot:plot",
}

PATH_ERRNOS = frozenset(
    {
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOENT,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)
"""OSErrors about a path that the environment, not the code, causes."""


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when they are run (or listed in --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        # Every command's module ships with the package: a missing one is a broken install, so it raises.
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        # Notes printed by the library in this process name options by field; the user reads flags.
        # (The worker processes it spawns wrap their stderr in it too: workers/spawned.py. A torchrun rank
        # runs this command itself.)
        stderr = sys.stderr
        sys.stderr = FlagsOnStream(stderr)  # type: ignore[assignment]
        try:
            return super().invoke(ctx)
        except DflashError as e:
            # A user-fixable problem: one clear line, no traceback, options named by their flags.
            raise click.ClickException(render(str(e))) from e
        except OSError as e:
            found = find_no_space(e)
            if found is not None:
                raise click.ClickException(str(NoSpaceError(found[1] or e.filename or "."))) from e
            if e.errno in PATH_ERRNOS and e.filename is not None:
                # The file system refused a path (read-only, permissions, a file where a folder should
                # be): the user's to fix, so one line naming it. Other OSErrors keep their traceback.
                raise click.ClickException(f"{e.filename}: {e.strerror}") from e
            raise
        finally:
            sys.stderr = stderr


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-offline")
def main() -> None:
    """Train DFlash speculative-decoding drafters offline: `dflash generate` captures target hidden
    states into a sharded cache, `dflash train` trains the drafter from it."""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
