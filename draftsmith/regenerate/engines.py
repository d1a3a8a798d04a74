"""Regenerate's generation engines: what answers a round of prompts, and the report every engine gives.

An engine takes token-id prompts and returns each one's generated ids (stop token included, when one ended it;
:class:`draftsmith.regenerate.turns.Regenerator` cuts there). :class:`Engine` is what the stage asks of every
engine, its report included; here: HF ``generate`` (:class:`GenerateEngine`), transformers' continuous batching
(:class:`ContinuousBatchingEngine`) and vLLM (:class:`VLLMEngine`). The static-cache engine, with its memory
plan, and the choice of ``auto`` are in :mod:`draftsmith.regenerate.static`.
"""

from __future__ import annotations

import torch

#: engines that run the target's own modules eagerly or in their own CUDA graphs, so ``fuse`` applies to them
#: (``continuous`` runs transformers' own graphs, ``vllm`` its own model)
FUSED_ENGINES = ("static", "generate")


class Engine:
    """A generation engine as the stage uses it: :attr:`name`, :meth:`generate` and :meth:`report`."""

    #: the ``regenerate.engine`` value that names it (``static``, ``generate``, ``continuous``, ``vllm``)
    name = ""

    def generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        """Each prompt's generated ids, in prompt order: the answer, the stop token that ended it (if one did), then
        possibly more ids (padding, or a row that kept decoding with its batch) that the caller cuts off.
        ``on_done(n)`` is called each time ``n`` more answers are done; ``on_step(rows, steps, tokens)``, by the
        engines that decode step by step here (``generate``, ``static``), within a batch: ``steps`` more decode steps
        of a batch of ``rows`` rows ran, generating ``tokens`` tokens in rows not stopped yet (the progress line's
        count of new tokens)."""
        raise NotImplementedError

    def report(self) -> dict:
        """The engine's part of the stage report, the same keys in the same order for every engine: ``engine`` (its
        name), ``cuda_graphs`` (``{"captured": n, "failed": n}`` decode-step CUDA graphs), ``memory_budget_gib``
        (GiB the engine fits its batches to), ``rows_capped_batches`` (batches cut to fit it) and
        ``static_engine`` (where the time went,
        :meth:`draftsmith.regenerate.static.StaticBatchEngine.phase_report`); ``None`` for what an engine does
        not have (all but ``engine`` here)."""
        return {"engine": self.name, "cuda_graphs": None, "memory_budget_gib": None, "rows_capped_batches": None,
                "static_engine": None}


class GenerateEngine(Engine):
    """HF ``generate``: prompts sorted by length, left-padded batches of ``batch_size``; a batch runs until its
    longest answer ends (the baseline the other engines are measured against, bench/bench_regenerate.py)."""

    name = "generate"

    def __init__(self, model, generation_config, pad_id: int, batch_size: int):
        self.model, self.gen, self.pad_id, self.batch_size = model, generation_config, pad_id, batch_size
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        stops = self.gen.eos_token_id
        stops = torch.tensor(stops if isinstance(stops, list) else [stops] if stops is not None else [])
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
                mask[r, width - len(prompts[i]):] = 1
            streamer = _StepCounter(len(idx), stops, on_step) if on_step is not None else None
            seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       generation_config=self.gen, streamer=streamer)
            for r, i in enumerate(idx):
                out[i] = seqs[r, width:].tolist()
            if on_done is not None:
                on_done(len(idx))
        return out  # type: ignore[return-value]


class _StepCounter:
    """A ``generate`` streamer (transformers' ``BaseStreamer`` protocol: ``put``, ``end``) that reports each decode
    step to ``on_step(rows, 1, tokens)``: ``tokens`` = rows of the batch that had not generated a stop id before the
    step (the first ``put`` is the prompt)."""

    def __init__(self, rows: int, stops: torch.Tensor, on_step):
        self.rows, self.stops, self.on_step = rows, stops, on_step
        self.live = None

    def put(self, value: torch.Tensor) -> None:
        if self.live is None:  # the prompt
            self.live = torch.ones(self.rows, dtype=torch.bool)
            return
        tokens = value.reshape(-1)[:self.rows].cpu()
        self.on_step(self.rows, 1, int(self.live.sum()))
        self.live &= ~torch.isin(tokens, self.stops)

    def end(self) -> None:
        pass


class ContinuousBatchingEngine(Engine):
    """transformers' continuous batching (``model.generate_batch``): a paged KV cache, each finished sequence's
    slot refilled by the next prompt at once, CUDA graphs for the decode steps on GPU. Greedy answers equal
    ``generate``'s (tested on CPU; bench/bench_regenerate.py compares them on a GPU).

    On a GPU transformers sizes the cache from the free device memory. On the CPU it would size it from the host's
    memory (tens of GB, and an attention mask of ``max_batch_tokens x cache tokens`` filled on every batch: 35 s of
    a 4-prompt, 12-token test on 2 cores), so there the cache is sized to the round's own tokens instead
    (:meth:`cpu_cache_config`)."""

    name = "continuous"

    def __init__(self, model, generation_config):
        self.model, self.gen = model, generation_config

    def cpu_cache_config(self, prompts: list[list[int]]):
        """A ``ContinuousBatchingConfig`` whose cache holds every prompt of the round and its
        ``max_new_tokens`` answer at once (``num_blocks`` pages of ``page_size`` tokens, one spare page a request)
        and whose batch is at most those tokens; ``None`` on a GPU (transformers' memory-based sizing)."""
        if next(self.model.parameters()).device.type != "cpu":
            return None
        from transformers import ContinuousBatchingConfig

        page = ContinuousBatchingConfig().page_size
        new = int(self.gen.max_new_tokens or 0)
        tokens = sum(len(p) + new for p in prompts)
        return ContinuousBatchingConfig(num_blocks=-(-tokens // page) + len(prompts),
                                        max_batch_tokens=max(1, min(8192, tokens)))  # 8192: transformers' default

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        if not prompts:
            return []
        results = self.model.generate_batch(inputs=prompts, generation_config=self.gen, progress_bar=False,
                                            continuous_batching_config=self.cpu_cache_config(prompts))
        # request ids are "req_<i>" in submission order (transformers 5.17 - 5.24); check, do not trust
        by_index = {}
        for rid, res in results.items():
            num = rid.rsplit("_", 1)[-1]
            if not num.isdigit():
                raise RuntimeError(f"continuous batching returned an unexpected request id {rid!r}")
            by_index[int(num)] = res
        if sorted(by_index) != list(range(len(prompts))):
            raise RuntimeError(f"continuous batching returned {len(by_index)} results for {len(prompts)} prompts")
        out = []
        for i, prompt in enumerate(prompts):
            res = by_index[i]
            if getattr(res, "error", None):
                raise RuntimeError(f"continuous batching failed on prompt {i}: {res.error}")
            if list(res.prompt_ids) != list(prompt):
                raise RuntimeError(f"continuous batching result {i} belongs to another prompt")
            out.append(list(res.generated_tokens))
        if on_done is not None:
            on_done(len(prompts))
        return out


class VLLMEngine(Engine):
    """vLLM (``vllm.LLM.generate`` on token ids), when the ``vllm`` package is installed; the target is loaded
    by vLLM itself from ``target_dir``. Not part of draftsmith's dependencies or CI."""

    name = "vllm"

    def __init__(self, target_dir: str, *, dtype: str, max_new_tokens: int, stop_ids: list[int], temperature: float,
                 top_p: float, seed: int, max_model_len: int | None, trust_remote_code: bool):
        try:
            import vllm
        except ImportError:
            raise ValueError("regenerate.engine = vllm but the vllm package is not installed; install it or use "
                             "engine: continuous") from None
        self.vllm = vllm
        self.llm = vllm.LLM(model=str(target_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            trust_remote_code=trust_remote_code)
        self.params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                          stop_token_ids=list(stop_ids), skip_special_tokens=False,
                                          include_stop_str_in_output=True)

    def generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, self.params, use_tqdm=False)
        out = []
        for o in outputs:
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and not set(ids) & set(self.params.stop_token_ids or []):
                ids.append(self.params.stop_token_ids[0])  # stopped at eos without returning it
            out.append(ids)
        if on_done is not None:
            on_done(len(prompts))
        return out
