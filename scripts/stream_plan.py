"""Entry point of rule stream_plan: the global plan of a run trained in slices -> results/stream/plan.json and each
slice's extraction plan (draftsmith.stream.build_stream_plan)."""

from pathlib import Path

from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

# the stage (torch, transformers) once the job's log is set up: an import failure lands in the log
from draftsmith.disk import DiskSpaceError  # noqa: E402
from draftsmith.stream import StreamPlanSettings, build_stream_plan  # noqa: E402

settings = StreamPlanSettings.from_rule(snakemake.params.settings, snakemake.config)
try:
    out = Path(snakemake.output.plan).parent  # results/stream: the slices and the held-out features go there
    build_stream_plan(snakemake.input.train, snakemake.input.target, out, settings, drafter_dir=out.parent / "drafter",
                      results_dir=out.parent)
except DiskSpaceError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
