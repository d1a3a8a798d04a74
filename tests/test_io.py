"""draftsmith.io: a failed job's own log holds the traceback that ended it; a damaged input or a full disk is one
error naming the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# -- damaged inputs and a full disk: one error naming the file ------------------------------------------------

def _truncated_parquet(path: Path, table) -> Path:
    """``table`` written as parquet, then cut to half its bytes (a copy interrupted, a disk that filled up)."""
    import pyarrow.parquet as pq

    pq.write_table(table, path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def _curated_table():
    import pyarrow as pa

    from draftsmith.curate import OUTPUT_SCHEMA

    messages = [{"role": "user", "content": "hi", "reasoning_content": None, "tool_calls": None,
                 "tool_call_id": None, "name": None}]
    return pa.Table.from_pylist([{"id": f"r{i}", "source": "s", "messages": messages, "tools": None}
                                 for i in range(200)], schema=OUTPUT_SCHEMA)


def _tokenized_table():
    import pyarrow as pa

    from draftsmith.tokenized import TOKENIZED_SCHEMA, tokenized_metadata

    rows = [{"id": f"r{i}", "source": "s", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_tokens": 3}
            for i in range(200)]
    return pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA.with_metadata(tokenized_metadata({}, "fp", 64)))


def _read_curated_for_tokenize(path):
    from draftsmith.tokenize import read_curated

    return list(read_curated(path))


def _read_curated_for_regenerate(path):
    from draftsmith.regenerate.shards import regenerate_file

    return regenerate_file(path, path.parent / "out.parquet", None, target_key="t", chunk_size=8)


def _read_curated_for_the_disk_plan(path):
    from types import SimpleNamespace

    from draftsmith.stream import check_disk_before_regeneration

    settings = SimpleNamespace(drafter=None, extract=None, stream=None,
                               target=SimpleNamespace(trust_remote_code=False))
    return check_disk_before_regeneration(path, path.parent / "target", path.parent / "plan.json", settings)


def _read_curated_for_evaluate(path):
    from draftsmith.evaluate.prompts import load_sets

    return load_sets(str(path), {}, heldout_sources=[])


def _read_tokenized(path):
    from draftsmith.tokenized import read_tokenized

    return read_tokenized(path)


def _read_tokenized_metadata(path):
    from draftsmith.tokenized import read_tokenized_metadata

    return read_tokenized_metadata(path)


def _read_regenerated_report(path):
    from draftsmith.regenerate.report import read_report

    return read_report(path)


@pytest.mark.parametrize("table, read", [
    ("curated", _read_curated_for_tokenize),
    ("curated", _read_curated_for_regenerate),
    ("curated", _read_curated_for_the_disk_plan),
    ("curated", _read_curated_for_evaluate),
    ("regenerated", _read_regenerated_report),  # regenerate's report of the regenerated parquet
    ("tokenized", _read_tokenized),  # extract, merge, stream_plan
    ("tokenized", _read_tokenized_metadata),  # evaluate
], ids=lambda v: getattr(v, "__name__", v))
def test_a_truncated_parquet_is_an_input_error_naming_it(tmp_path, table, read):
    from draftsmith.io import InputError

    path = _truncated_parquet(tmp_path / f"{table}.parquet",
                              _tokenized_table() if table == "tokenized" else _curated_table())
    with pytest.raises(InputError) as info:
        read(path)
    message = str(info.value)
    assert message.startswith(f"{path}: cannot be read (ArrowInvalid: ")
    assert f"expected a {table} parquet written by rule" in message
    assert "delete it and rerun the stage that writes it" in message
    assert info.value.path == str(path)


def test_a_full_disk_names_the_file_and_the_free_bytes_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno
    import shutil

    from draftsmith import io

    target = tmp_path / "out" / "report.json"

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.os, "replace", full)
    with pytest.raises(io.DiskFullError) as info:
        io.write_json(target, {"a": 1})
    message = str(info.value)
    assert str(target) in message and "no space left on device" in message
    free = shutil.disk_usage(tmp_path).free
    shown = int(message.split(" bytes free on ")[0].rsplit("(", 1)[1].replace(",", ""))
    assert abs(shown - free) < 64 << 20  # the free bytes of that file system (others write meanwhile)
    assert info.value.errno == errno.ENOSPC
    assert list((tmp_path / "out").iterdir()) == []  # no temporary file left behind
    # pyarrow's I/O errors carry ENOSPC in their message only: the same error
    monkeypatch.undo()
    with pytest.raises(io.DiskFullError, match=r"writing .*train\.parquet \("):
        with io.atomic_path(tmp_path / "train.parquet", suffix=".parquet"):
            raise OSError("IOError: [Errno 28] No space left on device")
    assert list(tmp_path.glob(".train.parquet*")) == []


def test_save_pretrained_atomic_writes_the_models_files_or_leaves_the_folder_as_it_was(tmp_path):
    """A drafter saved through save_pretrained_atomic has the files save_pretrained writes, byte for byte, beside
    the folder's other files; a save that dies after its first file leaves the folder's earlier files and no
    temporary folder."""
    import torch
    from safetensors.torch import load_file

    from draftsmith import io
    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.modeling import DFlashDraftModel
    from tiny import tiny_config

    cfg = build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                               mask_token_id=3)
    torch.manual_seed(0)
    model = DFlashDraftModel(cfg)
    model.save_pretrained(tmp_path / "direct")
    folder = tmp_path / "trained"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    io.save_pretrained_atomic(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "trainer_state.json"]
    assert (folder / "config.json").read_text() == (tmp_path / "direct" / "config.json").read_text()
    want, got = load_file(tmp_path / "direct" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    class Dies:
        def save_pretrained(self, out, **kwargs):
            (Path(out) / "model.safetensors").write_bytes(b"half a weight file")
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        io.save_pretrained_atomic(Dies(), folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct", "trained"]  # no temporary folder left


SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_a_safetensors_write_on_a_full_disk_is_a_disk_full_error_naming_the_final_file(tmp_path, monkeypatch):
    """Issue 46 item 2: safetensors reports ENOSPC as ``SafetensorError`` (not an OSError). A trained/ or final/
    folder (save_pretrained_atomic) and a chunk (atomic_path) written on a full disk raise DiskFullError naming the
    file under its final name and the free bytes; no temporary file or folder is left."""
    import torch
    from safetensors import SafetensorError

    from draftsmith import io, modeling
    from draftsmith.drafter_config import build_drafter_config
    from tiny import tiny_config

    def full(*args, **kwargs):
        raise SafetensorError(SAFETENSORS_FULL)

    assert io.is_disk_full(SafetensorError(SAFETENSORS_FULL)) and not io.is_disk_full(SafetensorError("bad header"))
    cfg = build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                               mask_token_id=3)
    model = modeling.DFlashDraftModel(cfg)
    monkeypatch.setattr(modeling, "save_file", full)
    folder = tmp_path / "drafter" / "final"
    with pytest.raises(io.DiskFullError) as info:
        io.save_pretrained_atomic(model, folder, dtype=torch.bfloat16)
    message = str(info.value)
    assert f"no space left on device writing {folder / 'model.safetensors'} (" in message
    assert " bytes free on " in message and info.value.filename == str(folder / "model.safetensors")
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == []  # no temporary folder left

    with pytest.raises(io.DiskFullError, match=rf"writing {tmp_path / 'chunk-00000.safetensors'} \(.* bytes free"):
        with io.atomic_path(tmp_path / "chunk-00000.safetensors") as tmp:
            full(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def _killed_writer(code: str) -> int:
    """Run ``code`` in a Python process that SIGKILLs itself where the code calls ``die()``; returns its pid (dead)."""
    prelude = "import os, signal\ndef die():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    proc = subprocess.Popen([sys.executable, "-c", prelude + code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -9, err[-3000:]
    return proc.pid


def test_temporaries_of_dead_writers_are_removed_and_those_of_live_ones_kept(tmp_path, caplog):
    """Issue 46 item 2: a writer killed (SIGKILL) inside atomic_path leaves its temporary file; the next write of the
    same file removes it and names it in the log. A live writer's temporary (its pid runs on this host) and one
    whose writer cannot be told (another host's) but written since this run started are left alone; one of an unknown
    writer older than the run is removed by the next writer of that file, and kept but named and counted by a check
    over a whole folder (where other jobs write)."""
    import logging
    import time

    from draftsmith import io

    caplog.set_level(logging.INFO, logger="draftsmith")
    out = tmp_path / "out"
    pid = _killed_writer(f"from draftsmith.io import atomic_path\n"
                         f"with atomic_path({str(out / 'train.parquet')!r}, suffix='.parquet') as tmp:\n"
                         f"    tmp.write_bytes(b'half a parquet')\n"
                         f"    die()\n")
    (left,) = out.glob(".train.parquet.*")
    assert left.name.endswith(f".tmp-{pid}@{io.HOST}.parquet")
    hour_ago = io.PROCESS_START - 3600
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        alive = out / f".train.parquet.abcd1234.tmp-{live.pid}@{io.HOST}.parquet"
        alive.write_bytes(b"being written")
        other = out / ".train.parquet.efgh5678.tmp-12@elsewhere.parquet"
        other.write_bytes(b"another host's")
        old = out / ".train.parquet.ijkl9012.tmp.parquet"  # the name main's atomic_path gave: no writer in it
        old.write_bytes(b"an older run's")
        os.utime(old, (hour_ago, hour_ago))
        unrelated = out / ".eval.parquet.mnop3456.tmp.parquet"
        os.link(old, unrelated)
        io.write_text(out / "train.parquet", "done")
        assert sorted(p.name for p in out.iterdir()) == sorted([alive.name, other.name, unrelated.name,
                                                                "train.parquet"])
        assert "removed 2 temporary file(s) of dead writers, 0.000 GB: " in caplog.text
        assert f"{left} (14 bytes, pid {pid} is not running on {io.HOST})" in caplog.text
        assert f"{old} (14 bytes, older than this run's start)" in caplog.text
        assert str(alive) not in caplog.text and str(other) not in caplog.text  # being written: left alone

        # a check over a whole folder (other jobs write there): only what is known dead goes; an unknown writer's
        # temporary older than this run is kept, named and counted
        found = {t.path: t.state for t in io.find_temporaries(tmp_path, recursive=True, by_age=False)}
        assert found == {unrelated: "stale", alive: "live", other: "live"}
        os.utime(other, (hour_ago, hour_ago))
        caplog.clear()
        removed, stale = io.remove_dead_temporaries(tmp_path, recursive=True, by_age=False, what="disk check")
        assert removed == [] and [t.path for t in stale] == [unrelated, other]
        assert f"disk check: kept 2 temporary file(s) whose writer may still run, 0.000 GB: {unrelated}" in caplog.text
        assert "pid 12 on elsewhere, not known to be gone, last written before this run started" in caplog.text
        note = io.temporaries_note(stale)
        assert note.startswith(" 2 temporary file(s) whose writer may still run hold 0.000 GB (") and str(other) in note
        # a running pid that started after the file was last written is a reused pid, not its writer
        reused = out / f".train.parquet.qrst7890.tmp-{live.pid}@{io.HOST}.parquet"
        reused.write_bytes(b"x")
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        io.write_text(out / "train.parquet", "done")  # the next writer of train.parquet: another host's old one goes
        assert not reused.exists() and not other.exists() and alive.exists()
    finally:
        live.kill()
        live.wait()
    # the pid is gone now: the next writer removes its temporary
    io.write_text(out / "train.parquet", "again")
    assert not alive.exists()
