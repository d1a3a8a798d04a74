"""Entry point of rule disk_plan: refuse, before regeneration, a run whose features cannot fit the disk
(draftsmith.stream.check_disk_before_regeneration); writes the projection when they fit."""

from pathlib import Path

from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

# the stage (tokenizer, transformers) once the job's log is set up: an import failure lands in the log
from draftsmith.disk import DiskSpaceError  # noqa: E402
from draftsmith.stream import DiskPlanSettings, check_disk_before_regeneration  # noqa: E402
from draftsmith.target_checks import check_target_in_job  # noqa: E402

# an embedded target materialised in this run was not there when the workflow was planned: the settings are checked
# against it here, before regeneration's GPU hours (rules/common.smk checks them at planning when it exists)
check_target_in_job(snakemake.config, snakemake.input.target, log)

# the rule has no params: everything disk_plan reads is a runtime key (it checks; it never reruns a stage)
settings = DiskPlanSettings.from_rule({}, snakemake.config)
# the disk is measured where the bytes go: the features under results/features (results/stream in stream mode), the
# checkpoints and the trained drafter under results/drafter
results = Path(snakemake.output[0]).parent.parent
try:
    check_disk_before_regeneration(snakemake.input.conversations, snakemake.input.target, snakemake.output[0],
                                   settings, features_dir=results / ("stream" if settings.stream.slices > 1 else
                                                                     "features"),
                                   drafter_dir=results / "drafter", results_dir=results)
except DiskSpaceError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
