"""Lint: ruff (pycodestyle, pyflakes, import sorting, no unused ``noqa``: pyproject.toml's [tool.ruff]) is clean over
the repository.

The code's ``noqa`` comments are written against these rules (RUF100 flags one that suppresses nothing); this test is
what makes them mean something in CI. The workflow files: snakefmt's format and ``snakemake --lint``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_snakefmt_is_clean():
    """snakefmt (pyproject.toml's [tool.snakefmt]): the Snakefile and rules/*.smk are formatted as it would, rule
    directives in its order."""
    snakefmt = shutil.which("snakefmt") or (Path(sys.executable).parent / "snakefmt")
    if not Path(snakefmt).exists():
        pytest.skip("snakefmt is not installed (pip install -e '.[test]' installs it on Python >= 3.11)")
    proc = subprocess.run([str(snakefmt), "--check", "--compact-diff", "Snakefile", "rules"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_snakemake_lint_is_clean():
    """``snakemake --lint``: every rule has log, benchmark and a conda environment, no shell command reads a
    global, functions live in rules/common.smk."""
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--cores", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Congratulations, your workflow is in a good condition!" in out, out[-6000:]


STAGES = {"assets", "curate", "regenerate", "tokenize", "extract", "merge", "train", "export", "evaluate"}


def test_no_stage_module_imports_another_stage():
    """Stages share code through shared modules (chat, tokenized, features, target, modeling, ...), never by
    importing each other: a stage's internals can change without another stage breaking."""
    import ast

    found = []
    for path in sorted((REPO / "draftsmith").rglob("*.py")):
        stage = path.relative_to(REPO / "draftsmith").parts[0].removesuffix(".py")
        if stage not in STAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"draftsmith.{a.name}" for a in node.names if node.module == "draftsmith"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in STAGES and parts[1] != stage:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)
