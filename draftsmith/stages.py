"""Which configuration keys each stage reads, and which of them its outputs depend on.

One table (:data:`STAGE_KEYS`) for the workflow and the tests. Per rule and config section, two kinds of key:

* **output** keys decide what the stage writes (a learning rate, a token budget of the answers, a storage dtype).
  The rule passes exactly these as ``params``, so Snakemake reruns the stage, and what depends on it, when one
  changes (params are a default rerun trigger) and never when anything else does.
* **runtime** keys decide only how the work runs: threads, batch sizes of inference, progress and checkpoint
  cadence, kernel choices, download locations. Outputs are the same (up to floating-point rounding of another
  batching or kernel), so they are read from the config at run time and changing one reruns nothing.

A key the table does not name for a stage is not given to that stage at all. ``tests/test_workflow.py`` changes
every schema key in turn on a finished run and checks that ``snakemake -n`` plans exactly the stages that read
it as an output key, and the stages downstream of them.

Keys whose change alters the DAG itself (``target.model``, ``assets.dir``, ``data.sources``,
``regenerate.enabled``, ``regenerate.shards``, ``extract.shards``, ``stream.slices``, ``train.epochs`` and
``stream.reuse`` in stream mode) act through input and output paths as well.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

from draftsmith.target_layers import num_tapped_layers

#: what training reads of ``train`` and ``drafter``: the same for a whole run (rule ``train``) and for each phase of a
#: sliced one (rule ``train_phase``), so a key added here marks both stale
TRAINING_KEYS: dict[str, tuple[str, ...]] = {
    "output": ("gpus", "seed", "epochs", "max_steps", "lr", "weight_decay", "warmup_ratio", "min_lr_ratio",
               "grad_clip", "tokens_per_batch", "grad_accum", "num_anchors", "max_anchors_per_row", "loss_gamma",
               "loss_weighting", "dpace_alpha", "optimizer", "muon_lr", "muon_weight_decay", "labels", "labels_topk",
               "eval_fraction", "attention", "compile", "selector_loss_weight",
               "selector_stop_gradient"),
    "runtime": ("save_every", "eval_every", "keep_checkpoints", "prefetch", "log_every", "loader_workers",
                "progress_interval", "logits_chunk_mib", "activation_checkpointing", "time_phases",
                "profile_steps")}
#: init_from: the start folder (its files are inputs too: rules/common.smk init_from_files); with it, planning made the
#: shape keys the folder's (draftsmith.warm_start.resolve_init_from)
DRAFTER_KEYS: dict[str, tuple[str, ...]] = {
    "output": ("init_from", "num_layers", "block_size", "target_layer_ids", "num_target_features", "mask_token_id",
               "layer_types", "sliding_window", "intermediate_size", "is_causal", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rope_theta", "architecture", "conv_kernel_size",
               "conv_group_size", "selector_rank", "selector_top_k")}

#: rule -> section -> {"output": keys, "runtime": keys}
STAGE_KEYS: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "fetch_dataset": {"assets": {"runtime": ("dir", "index_url", "wheelhouse")}},
    "fetch_target": {"assets": {"runtime": ("dir", "index_url", "wheelhouse")}},
    "materialize_target": {"assets": {"output": ("target_dtype",), "runtime": ("dir", "index_url", "wheelhouse")}},
    # on_bad_line: a malformed record is dropped and counted, or stops the job (what is written is the same)
    "curate": {"data": {"output": ("seed", "eval_fraction", "max_chars"), "runtime": ("on_bad_line",)}},
    "regenerate_shard": {
        # engine, batch size and memory budget change how fast, not what: greedy answers are the target's either way (in
        # float32 token for token; in bf16 another batching may flip near-tied argmaxes). shards changes which rows
        # each shard job writes (the assembled output stays the same rows)
        "regenerate": {"output": ("max_new_tokens", "temperature", "top_p", "num_answers", "seed", "max_turns",
                                  "shards"),
                       "runtime": ("engine", "batch_size", "memory_gib", "fuse", "chunk_size", "gpus")},
        "target": {"output": ("dtype", "attn_implementation", "trust_remote_code")},
        "tokenize": {"output": ("chat_template_kwargs", "max_length")},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    # the assembler: checks it was given every shard (what it writes is the shards' rows, whatever their number)
    "regenerate": {"regenerate": {"runtime": ("shards",)}},
    "tokenize": {
        "tokenize": {"output": ("max_length", "overflow", "chat_template_kwargs"), "runtime": ("threads",)},
        "target": {"output": ("trust_remote_code",)},
    },
    "extract_plan": {
        "extract": {"output": ("shards", "storage_dtype", "store_target_tokens", "store_target_topk"),
                    "runtime": ("disk_headroom",)},
        # the tapped layers: target_layer_ids, else num_target_features (else num_layers) evenly spread; the
        # drafter's size only sizes the disk reserve for checkpoints (runtime)
        "drafter": {"output": ("target_layer_ids", "num_target_features"),
                    "runtime": ("num_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "export_dtype", "architecture", "conv_kernel_size", "conv_group_size",
                                "selector_rank")},
        "train": {"runtime": ("keep_checkpoints",)},
        "stream": {"runtime": ("reserve_gb",)},
        "target": {"output": ("trust_remote_code",)},
    },
    "extract_shard": {
        "extract": {"output": ("storage_dtype", "store_target_tokens", "store_target_topk", "chunk_tokens"),
                    "runtime": ("token_budget", "padding_mask", "require_fla", "disk_headroom", "fuse")},
        "target": {"output": ("dtype", "attn_implementation", "trust_remote_code")},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    "merge": {"merge": {"runtime": ("verify_sha256",)}},
    # stream mode (stream.slices > 1, docs/stream.md): the global plan, each slice's extraction and merge, a phase
    "stream_plan": {
        "stream": {"output": ("slices", "reuse", "heldout_samples"), "runtime": ("slices_on_disk", "reserve_gb")},
        # what decides the plan's rows and steps (the rest of train only decides how they are trained)
        "train": {"output": ("gpus", "seed", "epochs", "max_steps", "tokens_per_batch", "grad_accum",
                             "eval_fraction"),
                  "runtime": ("keep_checkpoints",)},
        "extract": {"output": ("shards", "storage_dtype", "store_target_tokens", "store_target_topk"),
                    "runtime": ("disk_headroom",)},
        # the tapped layers (output); the drafter's size only sizes the disk reserve for checkpoints (runtime)
        "drafter": {"output": ("target_layer_ids", "num_target_features"),
                    "runtime": ("num_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "export_dtype", "architecture", "conv_kernel_size", "conv_group_size",
                                "selector_rank")},
        "target": {"output": ("trust_remote_code",)},
    },
    "extract_heldout": {
        "extract": {"output": ("storage_dtype", "store_target_tokens", "store_target_topk", "chunk_tokens"),
                    "runtime": ("token_budget", "padding_mask", "require_fla", "disk_headroom", "fuse")},
        "target": {"output": ("dtype", "attn_implementation", "trust_remote_code")},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    "extract_slice": {
        "extract": {"output": ("storage_dtype", "store_target_tokens", "store_target_topk", "chunk_tokens"),
                    "runtime": ("token_budget", "padding_mask", "require_fla", "disk_headroom", "fuse")},
        "target": {"output": ("dtype", "attn_implementation", "trust_remote_code")},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    "merge_slice": {"merge": {"runtime": ("verify_sha256",)}},
    "train_phase": {
        "train": TRAINING_KEYS,
        "drafter": DRAFTER_KEYS,
        "stream": {"output": ("slices", "reuse", "heldout_samples")},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    "train": {
        "train": TRAINING_KEYS,
        "drafter": DRAFTER_KEYS,
        "gpu": {"runtime": ("cpu_fallback",)},
    },
    "export": {"drafter": {"output": ("export_dtype",)}},
    # before regeneration: an upper bound of the features against the free disk (checks only; never reruns)
    "disk_plan": {
        "regenerate": {"runtime": ("max_new_tokens", "max_turns", "num_answers")},
        "tokenize": {"runtime": ("max_length", "chat_template_kwargs")},
        "extract": {"runtime": ("storage_dtype", "store_target_tokens", "store_target_topk", "disk_headroom")},
        "drafter": {"runtime": ("target_layer_ids", "num_target_features", "num_layers", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "export_dtype",
                                "architecture", "conv_kernel_size", "conv_group_size", "selector_rank")},
        "train": {"runtime": ("keep_checkpoints", "gpus", "seed", "epochs", "max_steps", "tokens_per_batch",
                              "grad_accum", "eval_fraction")},
        "stream": {"runtime": ("slices", "slices_on_disk", "reuse", "reserve_gb", "accept_disk_risk")},
        "target": {"runtime": ("trust_remote_code",)},
    },
    "evaluate": {
        "evaluate": {"output": ("temperature", "top_p", "top_k", "prompt_lookup_ngram", "prompt_lookup_num_tokens",
                                "block_size", "seed", "max_prompt_tokens", "stop_tokens", "only", "sets", "mtp"),
                     "runtime": ("gpus", "workers_per_gpu", "rollback", "static_cache", "progress_interval",
                                 "checkpoint_interval")},
        "target": {"output": ("dtype", "attn_implementation", "trust_remote_code")},
        # the start drafter (its files are inputs too): decoded beside the trained one, the report's before -> after
        "drafter": {"output": ("init_from",)},
        "gpu": {"runtime": ("cpu_fallback",)},
    },
}

#: the rule that writes each stage's outputs, in DAG order, with the rules that consume them
DOWNSTREAM: dict[str, tuple[str, ...]] = {
    "fetch_dataset": ("curate",),
    "fetch_target": ("materialize_target",),
    "materialize_target": ("disk_plan", "regenerate_shard", "tokenize", "extract_plan", "extract_shard",
                           "stream_plan", "extract_heldout", "extract_slice", "train_phase", "train", "export",
                           "evaluate"),
    "curate": ("disk_plan", "regenerate_shard", "tokenize", "evaluate"),
    "disk_plan": ("regenerate_shard",),
    "regenerate_shard": ("regenerate",),
    "regenerate": ("tokenize",),
    "tokenize": ("extract_plan", "extract_shard", "merge", "stream_plan", "extract_heldout", "extract_slice",
                 "merge_slice", "train_phase", "train", "evaluate"),
    "extract_plan": ("extract_shard", "merge"),
    "extract_shard": ("merge",),
    "merge": ("train",),
    "stream_plan": ("extract_heldout", "extract_slice", "merge_slice", "train_phase", "train"),
    "extract_heldout": ("train_phase", "train"),
    "extract_slice": ("merge_slice", "train_phase"),
    "merge_slice": ("train_phase",),
    "train_phase": ("extract_slice", "train"),
    "train": ("export", "evaluate"),
    "export": ("evaluate",),
    "evaluate": (),
}


def _keys(stage: str, kind: str) -> dict[str, tuple[str, ...]]:
    try:
        sections = STAGE_KEYS[stage]
    except KeyError:
        raise KeyError(f"unknown stage {stage!r} (known: {', '.join(STAGE_KEYS)})") from None
    return {section: kinds.get(kind, ()) for section, kinds in sections.items() if kinds.get(kind)}


def _effective(config: Mapping, stage: str, section: str, key: str) -> Any:
    """A key's value as the stage sees it (one derived value: the number of tapped layers)."""
    value = config[section].get(key)
    if (stage in ("extract_plan", "stream_plan") and (section, key) == ("drafter", "num_target_features")
            and value is None and config[section].get("target_layer_ids") is None):
        value = num_tapped_layers(None, None, config[section].get("num_layers"))
    return value


#: Output keys added after runs existed, with the value every run before had: a config at that value renders the
#: rule's params without the key (the text Snakemake recorded for those runs), so upgrading draftsmith reruns nothing;
#: another value is a new param and reruns the stage. :func:`stage_config` gives the stage the key either way.
LATER_OUTPUT_KEYS: dict[tuple[str, str], Any] = {("train", "selector_stop_gradient"): True,
                                                  ("extract", "store_target_topk"): 0,
                                                  ("train", "labels_topk"): None}

#: Mappings whose key order is part of the output (the report lists the evaluation sets in config order):
#: :func:`rule_params` keeps their order and canonicalises their values only.
ORDERED_MAPPINGS = {("evaluate", "sets")}


def canonical(value: Any) -> Any:
    """``value`` with every mapping's keys in sorted order, recursively (lists keep their order).

    Snakemake reruns a job whose params' text differs from the last run's, and a dict's text follows its key
    order: without this, the same config written with keys in another order (a source's ``name`` / ``path`` /
    ``adapter`` swapped) would rerun the whole pipeline.
    """
    if isinstance(value, Mapping):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def rule_params(config: Mapping, stage: str) -> dict[str, dict[str, Any]]:
    """The ``params`` of ``stage``'s rule: ``{section: {key: value}}`` of its output keys only, each value in
    :func:`canonical` form (:data:`ORDERED_MAPPINGS` keep their own order), less the :data:`LATER_OUTPUT_KEYS` at
    the value runs before them had.

    Raises:
        KeyError: an unknown stage, or a key missing from the (schema-validated) config.
    """
    def value(section: str, key: str) -> Any:
        v = _effective(config, stage, section, key)
        if (section, key) in ORDERED_MAPPINGS and isinstance(v, Mapping):
            return {name: canonical(item) for name, item in v.items()}
        return canonical(v)

    def earlier(section: str, key: str) -> bool:  # a later key at the value runs before it had: left out
        return ((section, key) in LATER_OUTPUT_KEYS
                and _effective(config, stage, section, key) == LATER_OUTPUT_KEYS[(section, key)])

    return {section: {key: value(section, key) for key in keys if not earlier(section, key)}
            for section, keys in _keys(stage, "output").items()}


def stage_config(stage: str, params: Mapping, config: Mapping) -> Mapping[str, Mapping[str, Any]]:
    """Everything ``stage`` reads, read-only: the rule's output-key ``params`` plus its runtime keys from the
    config (``snakemake.config`` in a script). Sections the stage does not read are absent.

    Raises:
        KeyError: a runtime key missing from the config.
    """
    merged: dict[str, dict[str, Any]] = {section: dict(values) for section, values in params.items()}
    for (section, key), default in LATER_OUTPUT_KEYS.items():  # left out of params at the value runs before had
        if key in _keys(stage, "output").get(section, ()) and key not in merged.get(section, {}):
            merged.setdefault(section, {})[key] = config[section].get(key, default)
    for section, keys in _keys(stage, "runtime").items():
        merged.setdefault(section, {}).update({key: config[section][key] for key in keys})
    return MappingProxyType({section: MappingProxyType(values) for section, values in merged.items()})


def affected(stages: set[str]) -> set[str]:
    """``stages`` and every stage downstream of them."""
    out, todo = set(), list(stages)
    while todo:
        stage = todo.pop()
        if stage not in out:
            out.add(stage)
            todo.extend(DOWNSTREAM[stage])
    return out


def num_phases(epochs: float, slices: int, reuse: int) -> int:
    """The phases of a stream-mode run (``stream.slices`` > 1): ``ceil(epochs / reuse)`` passes x ``slices``. The DAG
    declares them from the config alone; :class:`draftsmith.batch_plan.StreamPlan` makes exactly as many."""
    return math.ceil(epochs / reuse) * slices
