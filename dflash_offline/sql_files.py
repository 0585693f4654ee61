"""Locate the index SQL (``manifests/``): inside the installed wheel, or at the top of a source checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dflash_offline.errors import DflashError


def manifests_dir() -> Path:
    """The folder holding ``schema.sql`` and ``queries/*.sql``."""
    packaged = Path(str(resources.files("dflash_offline"))) / "manifests"
    if (packaged / "schema.sql").is_file():
        return packaged
    checkout = Path(__file__).resolve().parents[1] / "manifests"
    if (checkout / "schema.sql").is_file():
        return checkout
    raise DflashError(f"cannot find the index SQL: looked in {packaged} and {checkout}")


def read_schema() -> str:
    return (manifests_dir() / "schema.sql").read_text()


def named_queries() -> dict[str, str]:
    """Query name (file stem) -> SQL text, for ``dflash sql --query NAME``."""
    folder = manifests_dir() / "queries"
    return {p.stem: p.read_text() for p in sorted(folder.glob("*.sql"))}


def split_statements(sql: str) -> list[str]:
    """Statements of a SQL file: split at ';' that ends a line; comment-only pieces dropped."""
    pieces, current = [], []
    for line in sql.splitlines():
        current.append(line)
        if line.rstrip().endswith(";"):
            pieces.append("\n".join(current))
            current = []
    pieces.append("\n".join(current))
    code = []
    for piece in pieces:
        meaningful = [ln for ln in piece.splitlines() if ln.strip() and not ln.strip().startswith("--")]
        if meaningful:
            code.append(piece.strip())
    return code


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
