"""The stage scripts' logging: a failed job's own log holds the traceback that ended it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_uncaught_exception_lands_in_the_jobs_log_with_its_traceback(tmp_path):
    script = ("from draftsmith.io import setup_logging\n"
              "log = setup_logging('logs/stage.log')\n"
              "log.info('started')\n"
              "def inner():\n"
              "    raise ValueError('data.sources[mine]: bad row 3, field messages')\n"
              "inner()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert proc.returncode == 1
    log = (tmp_path / "logs" / "stage.log").read_text()
    assert "INFO started" in log
    assert "CRITICAL the job failed: ValueError: data.sources[mine]: bad row 3, field messages" in log
    assert "Traceback (most recent call last)" in log and ", in inner\n" in log
    # the console (Snakemake's) sees it once, not twice
    assert proc.stderr.count("Traceback (most recent call last)") == 1
