"""draftsmith: train DFlash speculative-decoding drafters for Hugging Face causal LMs.

One module per workflow stage (assets, curate, regenerate, tokenize, extract, merge, train, export,
evaluate), and shared modules the stages import instead of each other (tests/test_lint.py checks it): the
drafter model (:mod:`draftsmith.modeling`) and its configuration (:mod:`draftsmith.drafter_config`), target
loading and weight I/O (:mod:`draftsmith.target`), chat rendering and
the stop policy (:mod:`draftsmith.chat`), the tokenized parquet (:mod:`draftsmith.tokenized`), the feature
files (:mod:`draftsmith.features`), the configuration (:mod:`draftsmith.config`) and
which keys each stage reads (:mod:`draftsmith.stages`), GPU leases (:mod:`draftsmith.gpu`) and I/O
helpers (:mod:`draftsmith.io`). Every module imports without Snakemake.
"""

__version__ = "0.1.0"
