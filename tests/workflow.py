"""Workflow helpers shared by test_workflow.py, test_config.py and test_slurm.py: a copy of this checkout's
workflow files in a temporary folder, and the jobs a ``snakemake -n`` dry run plans.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "config.yaml", "rules", "scripts", "schemas", "draftsmith", "profiles", "config",
                  "envs")


def copy_workflow(dest: Path) -> Path:
    """The workflow files of this checkout (no results/, resources/, logs/) copied to ``dest``."""
    dest.mkdir(parents=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


def planned_jobs(output: str) -> dict[str, int]:
    """Rule -> job count from the 'Job stats' table that ``snakemake -n`` prints ({} when nothing to do)."""
    jobs: dict[str, int] = {}
    lines = output.splitlines()
    for k, line in enumerate(lines):
        if line.strip() == "Job stats:":
            for row in lines[k + 3:]:
                parts = row.split()
                if len(parts) != 2 or parts[0] == "total":
                    break
                jobs[parts[0]] = int(parts[1])
            break
    return jobs
