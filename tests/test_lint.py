"""Lint: ruff (pycodestyle + pyflakes, pyproject.toml's [tool.ruff]) is clean over the repository.

The code's ``noqa`` comments are written against these rules; this test is what makes them mean something in CI.
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


def test_snakemake_lint_is_clean():
    """``snakemake --lint``: every rule has log, benchmark and a conda environment, no shell command reads a
    global, functions live in rules/common.smk."""
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--cores", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Congratulations, your workflow is in a good condition!" in out, out[-6000:]
