"""``python -m draftsmith.evaluate.worker --worker W --args FILE``: one decoding worker of an evaluate job.

:func:`draftsmith.evaluate.run.run_evaluate` starts one per GPU when ``evaluate.gpus`` > 1; each decodes its
share of the conversations (:func:`draftsmith.evaluate.run.worker_of`) and saves them beside the report.
"""

import sys

from draftsmith.evaluate.run import main

if __name__ == "__main__":
    sys.exit(main())
