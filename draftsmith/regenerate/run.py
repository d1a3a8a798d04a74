"""The regenerate_shard job: load the target and its tokenizer, pick the engine, regenerate one shard.

``scripts/regenerate_shard.py`` builds :class:`~draftsmith.regenerate.settings.RegenerateShardSettings` from the
rule and calls :func:`run`; the assembler rule's script calls :func:`draftsmith.regenerate.shards.assemble_shards`.
"""

from __future__ import annotations

import logging
import os

import torch

from draftsmith import fused
from draftsmith.chat import check_template_kwargs, load_tokenizer, stop_token_ids
from draftsmith.io import target_fingerprint
from draftsmith.regenerate.engines import FUSED_ENGINES, VLLMEngine
from draftsmith.regenerate.report import summary
from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.regenerate.shards import regenerate_file
from draftsmith.regenerate.turns import Regenerator
from draftsmith.target import load_target

log = logging.getLogger("draftsmith.regenerate")


def run(*, conversations: str | os.PathLike, target_dir: str | os.PathLike, output: str | os.PathLike,
        settings: RegenerateShardSettings, shard: int = 0, device: str | torch.device | None = None) -> dict:
    """The regenerate_shard job: load the target (``settings.target``), regenerate shard ``shard`` of
    ``settings.regenerate.shards`` of the curated ``conversations`` into ``output``
    (:func:`~draftsmith.regenerate.shards.regenerate_file`, parts of ``settings.regenerate.chunk_size``); returns
    the report. Engine ``vllm`` loads the target itself; the others run it here, fused where
    ``settings.regenerate.fuse`` says (:data:`~draftsmith.regenerate.engines.FUSED_ENGINES` only).

    Raises:
        ValueError: see :class:`~draftsmith.regenerate.turns.Regenerator` and
            :func:`~draftsmith.regenerate.shards.regenerate_file`; FileNotFoundError: no target folder.
    """
    options, target = settings.regenerate, settings.target
    tokenizer = load_tokenizer(target_dir, trust_remote_code=target.trust_remote_code)
    stops = stop_token_ids(tokenizer, target_dir, check_template_kwargs(settings.tokenize.chat_template_kwargs))
    if options.engine == "vllm":
        model = None
        limit = settings.max_prompt_tokens
        engine = VLLMEngine(target_dir, dtype=target.dtype, max_new_tokens=options.max_new_tokens, stop_ids=stops,
                            temperature=options.temperature, top_p=options.top_p, seed=options.seed,
                            max_model_len=limit + options.max_new_tokens if limit else None,
                            trust_remote_code=target.trust_remote_code)
    else:
        model = load_target(target_dir, dtype=target.dtype, device=device,
                            attn_implementation=target.attn_implementation, trust_remote_code=target.trust_remote_code)
        engine = None
    regen = Regenerator(model, tokenizer, settings, stops, engine=engine)
    log.info("target %s (%s), engine %s, stop ids %s, pad id %d, settings %s", target_dir,
             next(model.parameters()).dtype if model is not None else target.dtype, regen.engine.name, regen.stop_ids,
             regen.pad_id, settings.to_dict())
    fuse = (regen.engine.name in FUSED_ENGINES
            and fused.resolve_fuse(options.fuse, next(model.parameters()).device))
    with fused.fused_target(model, enabled=fuse) as regen.fused:
        report = regenerate_file(conversations, output, regen, target_key=target_fingerprint(target_dir),
                                 chunk_size=options.chunk_size, shard=shard, shards=options.shards)
    log.info("%s", summary(report))
    return report
