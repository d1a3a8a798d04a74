"""draftsmith: train DFlash speculative-decoding drafters for Hugging Face causal LMs.

One module per workflow stage (assets, curate, regenerate, tokenize, extract, merge, train, export,
evaluate), plus the drafter model (:mod:`draftsmith.modeling`), GPU leases (:mod:`draftsmith.gpu`)
and I/O helpers (:mod:`draftsmith.io`). Every module imports without Snakemake.
"""

__version__ = "0.1.0"
