"""bench/repo_metrics.py, the repository and seam counts that bench/house_metrics.py prints, on small trees
whose counts are known by hand."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _repo_metrics() -> ModuleType:
    spec = importlib.util.spec_from_file_location("repo_metrics", ROOT / "bench" / "repo_metrics.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["repo_metrics"] = module
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_bench_lines_split_into_serving_and_plumbing_and_mentions_are_listed(tmp_path: Path) -> None:
    metrics = _repo_metrics()
    # The plumbing phrases are assembled here so that this file does not mention them itself.
    site, session, wheels = "/tmp/" + "site", "ninth " + "session", "." + "whl"
    _write(
        tmp_path,
        {
            "README.md": "a\nb\nc\nd\n",
            "bench/RESULTS.md": "x\n" * 7,
            "bench/cache_io.py": "import os\n\nprint(os.sep)\n",
            "bench/move.sh": f"cp -r {wheels} {site}\necho done\n",
            "docs/notes.md": f"Measured in the {session}.\n",
            "docs/clean.md": "A writer session is one ShardWriter's lifetime.\n",
            ".gitignore": "/." + "device/\n",
        },
    )
    files = metrics.tracked_files(tmp_path)
    assert ".gitignore" in files
    assert "bench/move.sh" in files
    repo = metrics.product_metrics(tmp_path, files)
    assert (repo["readme_lines"], repo["results_lines"], repo["facts_lines"]) == (4, 7, 0)
    assert (repo["bench_scripts"], repo["bench_script_lines"]) == (2, 5)
    assert (repo["bench_plumbing_scripts"], repo["bench_plumbing_lines"]) == (["bench/move.sh"], 2)
    # A writer's session is the product's word; .gitignore must name what it ignores.
    assert repo["files_mentioning_plumbing"] == ["bench/move.sh", "docs/notes.md"]


def test_decode_loops_sample_records_and_import_edges() -> None:
    metrics = _repo_metrics()
    source = textwrap.dedent(
        """
        from dataclasses import dataclass

        def greedy(model, ids, max_new_tokens):
            out = []
            while len(out) < max_new_tokens:
                out.append(model(ids + out).argmax())
            return out

        def speculative(model, ids, stop):
            tokens = []
            while not is_done(tokens, stop):
                tokens += model(ids)
            return tokens

        def batches(rows):
            for row in range(rows):
                yield row

        @dataclass(frozen=True)
        class Rows:
            sample_ids: tuple[str, ...]

        @dataclass
        class Plan:
            rows: Rows
            step: int

        @dataclass(frozen=True, slots=True)
        class Packed:
            features_TF: "torch.Tensor"

        @dataclass
        class Stats:
            seconds: float

        @dataclass
        class _Private:
            x_T: "np.ndarray"

        class NotARecord:
            rows: Rows
        """
    )
    tree = ast.parse(source)
    assert metrics.decode_loops(tree) == ["greedy", "speculative"]
    records = metrics.public_dataclasses(tree)
    assert list(records) == ["Rows", "Plan", "Packed", "Stats"]
    assert metrics.sample_records(records) == ["Packed", "Plan", "Rows"]
    graph = {
        "dflash_offline.eval.prompts": {"dflash_offline.train.split", "dflash_offline.data"},
        "dflash_offline.evaluation": {"dflash_offline.train.split"},  # not eval/: a name that only starts so
        "dflash_offline.train.length_mixing": {"dflash_offline.generate.config"},
    }
    assert metrics._edges(graph, "eval", "train") == [
        "dflash_offline.eval.prompts -> dflash_offline.train.split"
    ]
    assert metrics._edges(graph, "train", "generate") == [
        "dflash_offline.train.length_mixing -> dflash_offline.generate.config"
    ]
