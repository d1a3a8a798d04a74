"""The workflow frame: documented schema, parse-time config errors, full DAG, SLURM dry run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.config import ConfigError, check_eval_sets, config_errors, duplicate_key_errors
from workflow import copy_workflow, planned_jobs

REPO = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((REPO / "schemas" / "config.schema.yaml").read_text())
STAGE_RULES = ["fetch_dataset", "fetch_target", "materialize_target", "curate", "tokenize", "extract_plan",
               "extract_shard", "merge", "train", "export", "evaluate"]


def _walk(schema, path=""):
    for key, sub in (schema.get("properties") or {}).items():
        yield f"{path}{key}", sub
        yield from _walk(sub, f"{path}{key}.")
        items = sub.get("items")
        if isinstance(items, dict):
            yield from _walk(items, f"{path}{key}[].")
        extra = sub.get("additionalProperties")
        if isinstance(extra, dict):
            yield from _walk(extra, f"{path}{key}.*.")


def test_every_schema_key_is_documented():
    undocumented = [p for p, sub in _walk(SCHEMA) if not sub.get("description")
                    and not p.startswith("evaluate.sets.*")]
    assert undocumented == []


def test_every_optional_scalar_key_has_a_default():
    # List items and map values are exempt: their required keys are listed per item.
    missing = [path for path, sub in _walk(SCHEMA)
               if "[]" not in path and ".*." not in path and "default" not in sub]
    assert missing == []


def test_shipped_configs_are_valid():
    for name in ["config.yaml", *sorted(p.name for p in (REPO / "config").glob("*.yaml"))]:
        path = REPO / name if name == "config.yaml" else REPO / "config" / name
        assert config_errors(yaml.safe_load(path.read_text()), SCHEMA) == [], name


def _merged(*paths: Path) -> dict:
    """The configs layered as snakemake's --configfile does (snakemake.utils.update_config)."""
    from snakemake.utils import update_config

    config: dict = {}
    for path in paths:
        update_config(config, yaml.safe_load(path.read_text()) or {})
    return config


@pytest.mark.parametrize("overlay", sorted(p.name for p in (REPO / "docs/peers/recipe").glob("*.yaml")))
def test_recipe_overlays_are_valid_over_the_configs_their_runs_use(overlay):
    """A typo in an ablation's overlay would cost a device session: each must validate, and pass the cross-key
    rules, layered over what docs/peers/recipe.sh runs it with (DFlash2 variants: dflash2.yaml too; all: the top-k
    features)."""
    from draftsmith.config import cross_key_errors

    common = [REPO / "config.yaml", REPO / "config/gpu-proof.yaml", REPO / "docs/peers/quality.yaml"]
    if overlay.startswith("d2-"):
        common += [REPO / "docs/dflash2/dflash2.yaml"]
    common += [REPO / "docs/peers/topk-features.yaml"]  # the soft labels' overlays need it; the others ignore it
    config = _merged(*common, REPO / "docs/peers/recipe" / overlay)
    assert config_errors(config, SCHEMA) == []
    assert cross_key_errors(config) == []
    assert config["train"], overlay


@pytest.mark.parametrize("common", sorted(p.name for p in (REPO / "docs/peers").glob("*.yaml")))
def test_the_peers_common_configs_are_valid_over_gpu_proof(common):
    """The config files the peers' runs add to gpu-proof.yaml (COMPARE_CONFIGS, PEERS_CONFIGS) validate there."""
    from draftsmith.config import cross_key_errors

    config = _merged(REPO / "config.yaml", REPO / "config/gpu-proof.yaml", REPO / "docs/peers" / common)
    assert config_errors(config, SCHEMA) == []
    assert cross_key_errors(config) == []


@pytest.mark.parametrize("bad, key", [
    ({"extract": {"shards": -1}}, "extract.shards"),
    ({"extrakt": {"shards": 1}}, "'extrakt' was unexpected"),
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"drafter": {"layer_types": ["dense"]}}, "drafter.layer_types.0"),
    ({"evaluate": {"mtp": {"num_speculative_tokens": [0]}}}, "evaluate.mtp.num_speculative_tokens.0"),
    ({"evaluate": {"mtp": {"num_tokens": [2]}}}, "did you mean evaluate.mtp.num_speculative_tokens"),
    ({"data": {"sources": [{"name": "chat", "path": "x.jsonl", "adapter": "sharegpt"},
                           {"name": "tools", "path": "y.jsonl", "adapter": "nope"}]}},
     "data.sources.1 (tools).adapter"),
])
def test_bad_config_names_the_key(bad, key):
    errors = config_errors(bad, SCHEMA)
    assert errors and any(key in e for e in errors), errors


def _snakemake(tmp_path, *args, config_text=None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "config.yaml", work / "config.yaml")
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work), *args]
    if config_text is not None:
        (work / "extra.yaml").write_text(config_text)
        cmd += ["--configfile", str(work / "extra.yaml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bad_config_stops_snakemake_at_parse_time(tmp_path):
    proc = _snakemake(tmp_path, "-n", config_text="extract:\n  shards: -1\n")
    assert proc.returncode != 0
    assert "extract.shards: -1 is less than the minimum of 1" in proc.stdout + proc.stderr
    assert "Building DAG" not in proc.stdout + proc.stderr


def test_a_key_written_twice_is_named_with_its_file_and_lines(tmp_path):
    overlay = tmp_path / "my.yaml"
    overlay.write_text("train:\n  epochs: 5\ndata:\n  sources:\n    - {name: a, path: a.jsonl, name: b}\n"
                       "train:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    assert duplicate_key_errors(overlay) == [
        f"{overlay}:5: data.sources.0.name appears again (first on line 5); YAML keeps only the last one, so the "
        "keys under the first are lost: merge the two",
        f"{overlay}:6: train appears again (first on line 1); YAML keeps only the last one, so the keys under the "
        "first are lost: merge the two",
        f"{overlay}:8: train.lr appears again (first on line 7); YAML keeps only the last one, so the keys under "
        "the first are lost: merge the two",
    ]
    shipped = [REPO / "config.yaml", *sorted((REPO / "config").glob("*.yaml"))]
    assert [e for f in shipped for e in duplicate_key_errors(f)] == []


def test_an_overlay_with_a_repeated_section_stops_snakemake_at_parse_time(tmp_path):
    """Two `train:` sections in one overlay: YAML (and Snakemake) would keep the second and drop epochs."""
    proc = _snakemake(tmp_path, "-n", config_text="train:\n  epochs: 5\nextract:\n  shards: 2\ntrain:\n  lr: 1.0e-4\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "extra.yaml:5: train appears again (first on line 1)" in out, out
    assert "Building DAG" not in out


SOURCES = [{"name": "sharegpt", "split": "both"}, {"name": "champ", "split": "train"},
           {"name": "mtbench", "split": "eval"}]


@pytest.mark.parametrize("sets, sources, message", [
    ({"mt": {"source": "mtbnech"}}, SOURCES,
     "evaluate.sets.mt.source: 'mtbnech' is no data source (did you mean 'mtbench'?); sets can use "
     "['heldout', 'sharegpt', 'mtbench']; to leave the set out, name the sets to run in evaluate.only or set "
     "evaluate.sets.mt: null"),
    ({"math": {"source": "champ"}}, SOURCES,
     "evaluate.sets.math.source: 'champ' has split: train, so the eval split holds none of its rows"),
    ({"heldout": {"source": "heldout"}}, SOURCES[1:],
     "evaluate.sets.heldout.source: 'heldout' is the held-out split of the split: both sources, but no data "
     "source has split: both"),
    ({}, SOURCES, "evaluate.sets is empty"),
])
def test_eval_set_whose_source_the_eval_split_cannot_hold_is_refused(sets, sources, message):
    with pytest.raises(ConfigError) as err:
        check_eval_sets({"sets": sets}, sources)
    assert message in str(err.value)
    check_eval_sets({"sets": {"h": {"source": "heldout"}, "mt": {"source": "mtbench"},
                              "chat": {"source": "sharegpt"}}}, SOURCES)  # all fine


def test_evaluate_stop_tokens_is_refused_for_the_shared_stop_policy():
    with pytest.raises(ConfigError, match="generation_config.json"):
        check_eval_sets({"sets": {"h": {"source": "heldout"}}, "stop_tokens": ["<|eot_id|>"]}, SOURCES)


def test_eval_set_typo_stops_snakemake_at_parse_time(tmp_path):
    proc = _snakemake(tmp_path, "-n", config_text="evaluate:\n  sets:\n    mt: {source: mt-bench}\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "evaluate.sets.mt.source: 'mt-bench' is no data source (did you mean 'mtbench'?)" in out
    assert "Building DAG" not in out


def test_an_overlay_removes_a_set_with_null():
    """A --configfile overlay cannot delete a key of config.yaml (Snakemake merges them): `name: null` removes an
    evaluate set, so a config with its own sources can drop the benchmark sets that name the embedded ones."""
    from draftsmith.config import check_config

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["data"]["sources"] = [{"name": "mychat", "path": "/data/chat.jsonl", "adapter": "sharegpt",
                                  "split": "both"}]
    config["evaluate"]["sets"].update(mtbench=None, humaneval=None, bfcl=None, mmath=None)
    check_config(config, str(REPO / "schemas" / "config.schema.yaml"))
    assert list(config["evaluate"]["sets"]) == ["heldout"]
    assert config["evaluate"]["sets"]["heldout"]["max_prompts"] == 12
    check_eval_sets(config["evaluate"], config["data"]["sources"])  # no set names a missing source


def test_evaluate_only_chooses_the_sets():
    """`evaluate.only: [heldout]` over config.yaml, with one's own sources: only the held-out set is left (its
    settings from config.yaml), the sets naming the embedded benchmarks are gone before their sources are checked,
    and the evaluate rule's params carry the one set; a name that is no set stops with the key and a suggestion."""
    from draftsmith.config import check_config
    from draftsmith.evaluate.settings import EvaluateSettings
    from draftsmith.stages import rule_params

    schema_path = str(REPO / "schemas" / "config.schema.yaml")
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["data"]["sources"] = [{"name": "mychat", "path": "/data/chat.jsonl", "adapter": "sharegpt",
                                  "split": "both"}]
    config["evaluate"]["only"] = ["heldout"]
    check_config(config, schema_path)
    assert config["evaluate"]["sets"] == {"heldout": {"source": "heldout", "max_prompts": 12, "max_new_tokens": 64}}
    check_eval_sets(config["evaluate"], config["data"]["sources"])  # mtbench & co. are not checked: not chosen
    assert list(EvaluateSettings.from_config(config).evaluate.sets) == ["heldout"]
    assert list(rule_params(config, "evaluate")["evaluate"]["sets"]) == ["heldout"]
    # several, in evaluate.sets order whatever the order of `only`
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["evaluate"]["only"] = ["mmath", "heldout"]
    check_config(config, schema_path)
    assert list(config["evaluate"]["sets"]) == ["heldout", "mmath"]
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["evaluate"]["only"] = ["heldut"]
    with pytest.raises(ConfigError, match=r"evaluate.only: 'heldut' is no set of evaluate.sets "
                                          r"\(did you mean 'heldout'\?\); the sets are heldout, mtbench"):
        check_config(config, schema_path)


def test_dry_run_plans_every_stage(tmp_path):
    proc = _snakemake(tmp_path, "-n", config_text="regenerate:\n  enabled: true\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rule in STAGE_RULES + ["regenerate_shard", "regenerate"]:
        assert f"\n{rule} " in out or f"rule {rule}:" in out, rule


def test_regenerate_shards_plan_one_job_each_and_a_shard_outside_them_is_refused(tmp_path):
    """regenerate.shards: 2 plans regenerate_shard twice (shard-0, shard-1) and one regenerate that assembles both, in
    order; shard-5 of that config stops Snakemake while it builds the DAG, naming the key."""
    extra = "regenerate:\n  enabled: true\n  shards: 2\n"
    proc = _snakemake(tmp_path, "-n", "results/regenerated/train.parquet", config_text=extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    jobs = planned_jobs(out)
    assert jobs["regenerate_shard"] == 2 and jobs["regenerate"] == 1, jobs
    assert "input: results/regenerated/shard-0.parquet, results/regenerated/shard-1.parquet" in out
    proc = _snakemake(tmp_path, "-n", "results/regenerated/shard-5.parquet", config_text=extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "results/regenerated/shard-5.parquet: regenerate.shards is 2, so the shards are 0..1" in out


def test_building_the_dag_does_not_import_torch(tmp_path):
    """Snakemake parses the workflow and plans the DAG (every `snakemake` call, login nodes included) without
    importing torch: the rule files and what they import at parse time stay torch-free."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "config.yaml", work / "config.yaml")
    code = ("import sys\n"
            "from snakemake.cli import main\n"
            f"sys.argv = ['snakemake', '-s', {str(REPO / 'Snakefile')!r}, '-d', {str(work)!r}, '-n', '--cores', '1']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('PLANNED' if code in (0, None) else f'FAILED {code}')\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "PLANNED" in out, out[-3000:]
    assert "NO TORCH" in out, out[-3000:]


def test_dag_renders(tmp_path):
    proc = _snakemake(tmp_path, "--dag")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dot = proc.stdout[proc.stdout.index("digraph"):]
    for rule in ["curate", "tokenize", "extract_shard", "merge", "train", "export", "evaluate"]:
        assert f'label = "{rule}' in dot
    if shutil.which("dot"):
        svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60)
        assert svg.returncode == 0 and "<svg" in svg.stdout


def test_slurm_profile_dry_run_without_a_cluster(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    proc = _snakemake(tmp_path, "--workflow-profile", str(REPO / "profiles" / "slurm"), "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "extract_shard" in out and "train" in out and "evaluate" in out


def test_sampled_regeneration_needs_the_targets_own_labels():
    """Sampled answers (temperature > 0) are on-policy contexts, not labels: the check refuses a config whose
    training would learn the sampled tokens instead of the target's greedy next tokens."""
    from draftsmith.config import cross_key_errors

    sampled = {"regenerate": {"enabled": True, "temperature": 0.7}}
    assert cross_key_errors({**sampled, "extract": {"store_target_tokens": True}, "train": {"labels": "target"}}) == []
    for bad in ({"extract": {"store_target_tokens": False}}, {"train": {"labels": "data"}}):
        errors = cross_key_errors({**sampled, **bad})
        assert len(errors) == 1 and "store_target_tokens: true and train.labels: target" in errors[0]
    assert cross_key_errors({"regenerate": {"enabled": False, "temperature": 0.7}, "train": {"labels": "data"}}) == []
    topk = {"extract": {"store_target_tokens": True, "store_target_topk": 8}, "train": {"labels": "target_topk"}}
    assert cross_key_errors({**sampled, **topk}) == []


def test_soft_labels_need_the_targets_topk_in_the_features():
    """``train.labels: target_topk`` is refused before anything runs unless extraction stores a top-k of at least
    2 tokens and the greedy token, naming both keys and their values."""
    from draftsmith.config import cross_key_errors

    soft = {"train": {"labels": "target_topk"}}
    assert cross_key_errors({**soft, "extract": {"store_target_topk": 16}}) == []
    for extract, shown in (({}, "(it is 0)"), ({"store_target_topk": 1}, "(it is 1)"),
                           ({"store_target_topk": 8, "store_target_tokens": False}, "(it is False)")):
        errors = cross_key_errors({**soft, "extract": extract})
        assert len(errors) == 1 and "extract.store_target_topk >= 2" in errors[0] and shown in errors[0]
    assert cross_key_errors({"extract": {"store_target_topk": 8}, "train": {"labels": "target"}}) == []
    # train.labels_topk keeps the first of the stored tokens: it needs soft labels and at least that many stored
    narrow = {"extract": {"store_target_topk": 256}, "train": {"labels": "target_topk", "labels_topk": 32}}
    assert cross_key_errors(narrow) == []
    errors = cross_key_errors({**narrow, "extract": {"store_target_topk": 16}})
    assert len(errors) == 1 and "train.labels_topk 32" in errors[0] and "(it is 16)" in errors[0]
    # without soft labels it is not read (as D-PACE's alpha without D-PACE): no error
    assert cross_key_errors({**narrow, "train": {"labels": "target", "labels_topk": 32}}) == []


def test_a_drafter_shape_that_cannot_train_is_refused_before_anything_runs():
    """drafter.layer_types of another length than drafter.num_layers (an overlay that cuts num_layers but inherits
    gpu-node.yaml's five layer types), or sliding layers without a window, are refused at parse time, naming the
    keys: training would refuse them only after regenerate and extraction."""
    from draftsmith.config import cross_key_errors

    five = ["full_attention"] * 5
    assert cross_key_errors({"drafter": {"num_layers": 5, "layer_types": five}}) == []
    assert cross_key_errors({"drafter": {"num_layers": 2, "layer_types": None}}) == []
    (err,) = cross_key_errors({"drafter": {"num_layers": 2, "layer_types": five}})
    assert "drafter.layer_types has 5 entries for drafter.num_layers = 2" in err
    (err,) = cross_key_errors({"drafter": {"num_layers": 1, "layer_types": ["sliding_attention"]}})
    assert "drafter.sliding_window is not set" in err
    assert cross_key_errors({"drafter": {"num_layers": 1, "layer_types": ["sliding_attention"],
                                         "sliding_window": 64}}) == []


def readme_commands() -> list[str]:
    """Every `snakemake ...` command the README gives (inline or in a code block), except piped or redirected
    ones and those that need a finished run (--report)."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"`(snakemake[^`]*)`", text) + re.findall(r"^(snakemake [^\n#|]*?)\s*(?:#.*)?$", text, re.M)
    return sorted({c.strip() for c in found if not {"|", ">", "&&"} & set(c.split()) and "--report" not in c})


@pytest.mark.slow
def test_readme_commands_work_as_written(tmp_path):
    """Each README command, dry-run from a copy of the project with the shipped config, builds its DAG."""
    commands = readme_commands()
    assert "snakemake results/features/shard-1/manifest.json" in commands and "snakemake --until merge" in commands
    work = copy_workflow(tmp_path / "project")
    # the user's overlay the README's own-target recipe runs with (its target and data are the user's: here the
    # embedded ones, with the recipe's regeneration and evaluation-set keys)
    (work / "my.yaml").write_text("regenerate: {enabled: false}\nevaluate: {only: [heldout]}\n")
    assert {"snakemake --configfile=my.yaml -n", "snakemake --configfile=my.yaml results/tokenized/train.parquet",
            "snakemake results/tokenized/train.parquet --configfile my.yaml"} <= set(commands)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for command in commands:
        args = command.split()[1:]
        if "profiles/slurm" in args:
            pytest.importorskip("snakemake_executor_plugin_slurm")
        proc = subprocess.run([sys.executable, "-m", "snakemake", *args, "-n"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{command}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    # a shard the config does not have stops Snakemake while it builds the DAG, naming the key
    proc = subprocess.run([sys.executable, "-m", "snakemake", "results/features/shard-3/manifest.json", "-n"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("results/features/shard-3/manifest.json: extract.shards is 2, so the shards are 0..1"
            in proc.stdout + proc.stderr)


def test_every_schema_key_is_read_by_a_stage_or_shapes_the_dag():
    """draftsmith.stages names each schema key as an output or runtime key of some stage (a key no stage
    reads would be dead configuration); only the keys that reshape the DAG itself are absent."""
    from draftsmith.stages import STAGE_KEYS

    schema = yaml.safe_load((REPO / "schemas" / "config.schema.yaml").read_text())
    in_schema = {(section, key) for section, node in schema["properties"].items()
                 for key in (node.get("properties") or {})}
    named = {(section, key) for sections in STAGE_KEYS.values() for section, kinds in sections.items()
             for keys in kinds.values() for key in keys}
    assert named <= in_schema, sorted(named - in_schema)
    assert in_schema - named == {("target", "model"), ("data", "sources"), ("regenerate", "enabled")}
    for stage, sections in STAGE_KEYS.items():
        for section, kinds in sections.items():
            both = set(kinds.get("output", ())) & set(kinds.get("runtime", ()))
            assert not both, f"{stage}.{section}: {sorted(both)} both output and runtime"


def test_rule_params_hold_output_keys_and_stage_config_adds_runtime_ones():
    from draftsmith.config import check_config
    from draftsmith.stages import rule_params, stage_config

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    check_config(config, str(REPO / "schemas" / "config.schema.yaml"))
    params = rule_params(config, "tokenize")
    keys = ("max_length", "overflow", "chat_template_kwargs")
    assert params == {"tokenize": {k: config["tokenize"][k] for k in keys},
                      "target": {"trust_remote_code": config["target"]["trust_remote_code"]}}
    cfg = stage_config("tokenize", params, config)
    assert cfg["tokenize"]["threads"] == config["tokenize"]["threads"] and "drafter" not in cfg
    with pytest.raises(TypeError):
        cfg["tokenize"]["max_length"] = 1  # read-only
    assert rule_params(config, "export") == {"drafter": {"export_dtype": config["drafter"]["export_dtype"]}}
    # the tapped layers: with neither target_layer_ids nor num_target_features, num_layers decides them
    cfg2 = {**config, "drafter": {**config["drafter"], "target_layer_ids": None, "num_target_features": None,
                                  "num_layers": 3}}
    assert rule_params(cfg2, "extract_plan")["drafter"] == {"target_layer_ids": None, "num_target_features": 3}
    with pytest.raises(KeyError, match="unknown stage"):
        rule_params(config, "tokenise")


def test_a_later_output_key_at_the_value_runs_before_had_leaves_the_params_as_they_were():
    """``train.selector_stop_gradient`` came after runs existed: at its default (what they trained) the train
    rule's params text is what Snakemake recorded for them (no rerun on upgrade), and the stage still reads it;
    another value is in the params, so the stage reruns."""
    from draftsmith.config import check_config
    from draftsmith.stages import LATER_OUTPUT_KEYS, rule_params, stage_config

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    check_config(config, str(REPO / "schemas" / "config.schema.yaml"))
    assert ("train", "selector_stop_gradient") in LATER_OUTPUT_KEYS and config["train"]["selector_stop_gradient"]
    for stage in ("train", "train_phase"):
        params = rule_params(config, stage)
        assert "selector_stop_gradient" not in params["train"] and "selector_loss_weight" in params["train"]
        assert stage_config(stage, params, config)["train"]["selector_stop_gradient"] is True
        changed = {**config, "train": {**config["train"], "selector_stop_gradient": False}}
        params = rule_params(changed, stage)
        assert params["train"]["selector_stop_gradient"] is False
        assert stage_config(stage, params, changed)["train"]["selector_stop_gradient"] is False
    # extract.store_target_topk (soft labels) at 0: every extraction stage's params as before, the key still read
    assert config["extract"]["store_target_topk"] == 0
    soft = {**config, "extract": {**config["extract"], "store_target_topk": 16}}
    for stage in ("extract_plan", "extract_shard", "stream_plan", "extract_heldout", "extract_slice"):
        assert "store_target_topk" not in rule_params(config, stage)["extract"]
        assert stage_config(stage, rule_params(config, stage), config)["extract"]["store_target_topk"] == 0
        assert rule_params(soft, stage)["extract"]["store_target_topk"] == 16
    # train.labels_topk (the first k of the stored soft labels) at null: the train rules' params as before
    assert config["train"]["labels_topk"] is None
    for stage in ("train", "train_phase"):
        assert "labels_topk" not in rule_params(config, stage)["train"]
        assert stage_config(stage, rule_params(config, stage), config)["train"]["labels_topk"] is None
        narrow = {**config, "train": {**config["train"], "labels_topk": 32}}
        assert rule_params(narrow, stage)["train"]["labels_topk"] == 32


def test_dflash2_takes_speculators_recipe_by_default_and_dflash_runs_are_not_rerun():
    """Keys whose default is the drafter architecture's (``x-by-architecture``): a DFlash2 config trains with
    speculators' DFlash2 recipe (soft labels from the target's top 32, the selector's gradient, slot decay gamma 4,
    clip 3.4) and its extraction stores the top 32; a DFlash config gets exactly the params text of the explicit
    values runs before trained with (upgrading reruns nothing); a value the user sets wins."""
    import copy

    from draftsmith.config import check_config
    from draftsmith.extract.plan import ExtractPlanSettings
    from draftsmith.stages import rule_params
    from draftsmith.train.settings import TrainSettings

    schema = str(REPO / "schemas" / "config.schema.yaml")
    base = yaml.safe_load((REPO / "config.yaml").read_text())
    dflash2 = copy.deepcopy(base)
    dflash2["drafter"]["architecture"] = "dflash2"
    (note,) = check_config(dflash2, schema)  # logged by the Snakefile: which recipe the run trains
    assert note.startswith("drafter.architecture dflash2: its defaults ") and "train.labels target_topk" in note
    assert "extract.store_target_topk 32" in note and "train.grad_clip 3.4" in note
    recipe = {"labels": "target_topk", "loss_weighting": "exp", "loss_gamma": 4.0, "grad_clip": 3.4,
              "selector_stop_gradient": False}
    assert {k: dflash2["train"][k] for k in recipe} == recipe and dflash2["extract"]["store_target_topk"] == 32
    params = rule_params(dflash2, "train")["train"]
    assert {k: params[k] for k in recipe} == recipe
    assert rule_params(dflash2, "extract_shard")["extract"]["store_target_topk"] == 32  # DFlash -> DFlash2 re-extracts
    # DFlash: the values every run before had, so the params text is theirs
    dflash, explicit = copy.deepcopy(base), copy.deepcopy(base)
    explicit["train"].update(labels="target", loss_weighting="dpace", grad_clip=1.0, selector_stop_gradient=True)
    explicit["extract"]["store_target_topk"] = 0
    assert check_config(dflash, schema) == []  # the default architecture: nothing to say
    check_config(explicit, schema)
    for stage in ("train", "train_phase", "extract_plan", "extract_shard", "stream_plan"):
        assert rule_params(dflash, stage) == rule_params(explicit, stage), stage
    assert dflash["train"]["loss_gamma"] is None  # dflash's 7 B / 16, resolved when training starts
    # the user's value wins over the architecture's
    mine = copy.deepcopy(base)
    mine["drafter"]["architecture"] = "dflash2"
    mine["train"].update(grad_clip=1.0, labels="target")
    mine["extract"]["store_target_topk"] = 0
    check_config(mine, schema)
    assert (mine["train"]["grad_clip"], mine["train"]["labels"], mine["extract"]["store_target_topk"]) == (
        1.0, "target", 0)
    assert mine["train"]["loss_weighting"] == "exp"
    # library callers' settings resolve the same way, extraction from the drafter's architecture too
    s = TrainSettings.from_config({"drafter": {"architecture": "dflash2"}})
    assert {k: getattr(s.train, k) for k in recipe} == recipe
    assert TrainSettings.from_config({}).train.grad_clip == 1.0
    assert ExtractPlanSettings.from_config({"drafter": {"architecture": "dflash2"}}).extract.store_target_topk == 32
    assert ExtractPlanSettings.from_config({}).extract.store_target_topk == 0


def test_gpu_node_drafter_is_the_published_27b_shape():
    """config/gpu-node.yaml over config.yaml (as Snakemake merges --configfile) gives the drafter the benchmarks
    measure: 5 layers, one tap per layer at [1, 16, 31, 46, 61] of a 64-layer target, four sliding layers and a
    full one. (It once inherited config.yaml's 3 taps: the rehearsal on 2 x H200 tapped [1, 31, 61].)"""
    from snakemake.utils import update_config

    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.extract import PlanDrafterOptions, resolve_layer_ids

    merged = yaml.safe_load((REPO / "config.yaml").read_text())
    update_config(merged, yaml.safe_load((REPO / "config" / "gpu-node.yaml").read_text()))
    drafter = merged["drafter"]
    ids = resolve_layer_ids(PlanDrafterOptions.from_mapping(drafter), 64)
    assert ids == [1, 16, 31, 46, 61]
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=64, num_hidden_layers=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=256)
    cfg = build_drafter_config(target, num_layers=drafter["num_layers"], block_size=drafter["block_size"],
                               target_layer_ids=ids, mask_token_id=255, layer_types=drafter["layer_types"],
                               sliding_window=drafter["sliding_window"])
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert cfg.dflash_config["block_size"] == 16 and cfg.dflash_config["target_layer_ids"] == ids
