"""Entry point of rule extract_heldout: the held-out samples of a stream-mode run, extracted and indexed once (kept
for the whole run) -> results/stream/heldout/{shard-0/, index.json}.

Thin: leases one GPU, then draftsmith.extract.extract_shard on the held-out extraction plan (one shard, staged in
results/stream/.staging/heldout/shard-0/) and draftsmith.merge.merge_features over it. No held-out samples
(stream.heldout_samples 0, or train.eval_fraction 0): an empty folder, and training reports no held-out metrics.
"""

from pathlib import Path

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import read_json, setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

# torch is imported before the lease, CUDA starts after it, on the leased GPU only
import torch  # noqa: E402

from draftsmith.extract import ExtractHeldoutSettings, extract_shard  # noqa: E402
from draftsmith.merge import MergeSettings, merge_features  # noqa: E402

settings = ExtractHeldoutSettings.from_rule(snakemake.params.settings, snakemake.config)
lease_gpus(int(snakemake.resources.gpu), logger=log, job="extract_heldout", record=LEASE_LOG,
           cpu_fallback=settings.gpu.cpu_fallback)
torch.set_num_threads(int(snakemake.threads))
out = Path(snakemake.output[0])
if not read_json(snakemake.input.plan)["shards"][0]["rows"]:
    log.warning("no held-out samples (stream.heldout_samples or train.eval_fraction is 0): no held-out metrics")
    out.mkdir(parents=True, exist_ok=True)
else:
    extract_shard(
        plan_path=snakemake.input.plan,
        tokenized_path=snakemake.input.train,
        target_dir=snakemake.input.target,
        manifest_path=out / "shard-0" / "manifest.json",
        shard=0,
        settings=settings,
        staging_dir=out.parent / ".staging" / "heldout" / "shard-0",
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    merge_features(snakemake.input.plan, [out / "shard-0" / "manifest.json"], snakemake.input.train,
                   out / "index.json", settings=MergeSettings.from_config(snakemake.config), logger=log)
log_peak_memory(log)
