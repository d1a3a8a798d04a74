"""Benchmark: how long the tokenize stage's worker pool takes to start, against the way it started before.

:func:`draftsmith.tokenize.worker_pool` hands the ConversationTokenizer to its ``forkserver`` workers as a pickle in
a temporary file that each reads in its initializer. The baseline, measured in the same run, is the pool it replaced:
the same fork server preloads, the ConversationTokenizer sent as the pool's ``initargs``. A pool starts its processes
one by one and each start waits until the new process has read what it was sent, after re-importing the caller's
main module; with a real tokenizer (~1.6 MB pickled: more than a pipe holds) the baseline's start-up grows by one
main-module import per worker. Under Snakemake's ``script:`` that import runs Snakemake's preamble; here
``--main-import-s`` stands in for it (this file sleeps that long at import, in every worker).

Prints, per worker count, the seconds until every worker has answered a task, for both pools, and their ratio:

    PYTHONPATH=. python bench/pool_startup.py --tokenizer resources/targets/smollm2-135m-instruct --workers 2 16 \\
        --main-import-s 1

Without ``--tokenizer`` the tests' tiny tokenizer is used (its pickle fits a pipe: the baseline is not slowed).
"""
import argparse
import multiprocessing
import os
import sys
import time

time.sleep(float(os.environ.get("POOL_STARTUP_MAIN_IMPORT_S", "0")))  # the main-module import each worker repeats

from draftsmith import tokenize as T  # noqa: E402


def _initargs_init(worker):
    """The baseline's initializer: the ConversationTokenizer arrives pickled through the pool's ``initargs``."""
    T._WORKER = worker


def _answer(_):
    return os.getpid()


def time_pool(make_pool, workers: int) -> float:
    """Seconds from the pool's construction until each of ``workers`` processes has answered a task."""
    t = time.perf_counter()
    with make_pool() as pool:
        pids = set()
        while len(pids) < workers:
            pids |= set(pool.map(_answer, range(4 * workers), chunksize=1))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a target folder whose tokenizer to pickle (default: the tests' tiny one)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--main-import-s", type=float, default=0.0, help="seconds each worker's main-module import takes")
    args = ap.parse_args()
    os.environ["POOL_STARTUP_MAIN_IMPORT_S"] = str(args.main_import_s)  # read by the workers' re-import of this file
    if args.tokenizer:
        from draftsmith.chat import load_tokenizer
        tok = load_tokenizer(args.tokenizer)
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tiny import tiny_tokenizer
        tok = tiny_tokenizer()
    w = T.ConversationTokenizer(tok, T.TokenizeOptions(max_length=1024, overflow="truncate", chat_template_kwargs={},
                                                       threads=1))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["draftsmith.tokenize", type(tok).__module__])
    time_pool(lambda: ctx.Pool(1), 1)  # starts the fork server: neither pool below pays for it
    for n in args.workers:
        shipped = time_pool(lambda: T.worker_pool(w, n), n)
        baseline = time_pool(lambda: ctx.Pool(n, initializer=_initargs_init, initargs=(w,)), n)
        print(f"{n} workers (main-module import {args.main_import_s:g} s): worker_pool {shipped:.2f} s, "
              f"initargs baseline {baseline:.2f} s, {baseline / shipped:.1f}x", flush=True)


if __name__ == "__main__":
    main()
