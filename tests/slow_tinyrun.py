"""`tinyrun` for the pseudo-terminal tests: the first reply is slowed so Ctrl-C lands in its middle,
and each Model.generate call is logged (messages, chunks as they stream, stats) as JSON lines.

    SLOW_TINYRUN_LOG=log.jsonl SLOW_TINYRUN_DELAY=0.05 python tests/slow_tinyrun.py MODEL ...
"""

from __future__ import annotations

import json
import os
import time

from tinyinfer.runtime.cli import main
from tinyinfer.runtime.model import Model
from tinyinfer.runtime.numpy_backend import NumpyBackend

LOG = os.environ["SLOW_TINYRUN_LOG"]
DELAY = float(os.environ["SLOW_TINYRUN_DELAY"])
calls = []


def log(record: dict) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


real_forward = NumpyBackend.forward


def slow_forward(self, ids, start):
    if len(calls) == 1 and len(ids) == 1:    # decode steps of the first reply only
        time.sleep(DELAY)
    return real_forward(self, ids, start)


real_generate = Model.generate


def logged_generate(self, prompt, **kwargs):
    chunks = real_generate(self, prompt, **kwargs)
    calls.append(prompt)
    log({"call": len(calls), "messages": prompt})

    def stream():
        try:
            for chunk in chunks:
                log({"call": len(calls), "chunk": chunk})
                yield chunk
        finally:
            chunks.close()
            log({"call": len(calls), "stats": self.last_stats, "cached": len(self.cached_ids)})

    return stream()


NumpyBackend.forward = slow_forward
Model.generate = logged_generate
main()
