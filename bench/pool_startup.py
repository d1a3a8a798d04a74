"""Probe: how long the tokenize stage's worker pool takes to start, as it starts it.

:func:`draftsmith.tokenize.worker_pool` starts ``forkserver`` processes that each unpickle a ConversationTokenizer
(here one over the tests' tiny tokenizer, so the real tokenizer's larger pickle is not in the figure). Prints, per
worker count, the seconds until N half-second tasks have come back, less the half second, for two pools in a row
(the second one reuses the running fork server).

    PYTHONPATH=. python bench/pool_startup.py 2 16
"""
import os
import sys
import time

from draftsmith import tokenize as T


def _pid(_):
    time.sleep(0.5)
    return os.getpid()


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny import tiny_tokenizer
    t = time.perf_counter()
    tok = tiny_tokenizer()
    w = T.ConversationTokenizer(tok, T.TokenizeOptions(max_length=1024, overflow="truncate", chat_template_kwargs={},
                                                       threads=1))
    print(f"tiny tokenizer in {time.perf_counter() - t:.2f} s", flush=True)
    for n in [int(x) for x in sys.argv[1:]]:
        for rep in range(2):
            t = time.perf_counter()
            with T.worker_pool(w, n) as pool:
                pids = set(pool.map(_pid, range(n), chunksize=1))
            print(f"{n} workers, pool {rep}: {time.perf_counter() - t - 0.5:.2f} s to answer ({len(pids)} pids)",
                  flush=True)
