"""The mutation fuzzer over .tinf files, Hugging Face checkpoints and GGUF files (tests/fuzz_tinf.py),
each mutant run in a worker process with a time and a 2 GB memory limit (tests/adversary.py).

No mutant may hang, crash the process or end in an exception other than the project's own. CI runs
a few thousand; `pytest --long` runs 100,000 .tinf mutants (TINYINFER_FUZZ_CASES=N picks N, and
TINYINFER_FUZZ_SEED=S another set of mutants).
"""

from __future__ import annotations

import os
import sys
import time
from itertools import chain  # mutants are made one at a time: 100,000 would not fit in memory

from adversary import WorkerPool  # noqa: E402
from fuzz_tinf import gguf_mutants, hf_mutants, seed_gguf, seed_hf_files, seed_tinf, tinf_mutants  # noqa: E402

CI_TINF_CASES, LONG_TINF_CASES = 2500, 100_000
CI_CONVERTER_CASES, LONG_CONVERTER_CASES = 1000, 5000
WORKERS = 2
MAX_MESSAGE_CHARS = 600   # a project error is one sentence: a path and a bounded quote of the value


BASE_SEED = int(os.environ.get("TINYINFER_FUZZ_SEED", "0"))


def case_count(long_run: bool, ci: int, long: int, override: bool = True) -> int:
    if override and os.environ.get("TINYINFER_FUZZ_CASES"):
        return int(os.environ["TINYINFER_FUZZ_CASES"])
    return long if long_run else ci


def run_and_check(cases, label: str, count: int) -> None:
    started = time.monotonic()
    with WorkerPool(WORKERS) as pool:
        tally = pool.run_all(cases)
    seconds = time.monotonic() - started
    assert sum(tally.counts.values()) == count + 1   # every mutant and the seed ran
    print(f"\n{label}: {sum(tally.counts.values())} cases in {seconds:.1f} s: {tally.counts}, longest error "
          f"{tally.longest_message} chars, peak RSS {tally.peak_rss_mb:.0f} MB", file=sys.stderr)
    assert tally.failed() == 0, tally.failures
    assert tally.counts["ok"] >= 1, "not even the seed was accepted: the mutants test nothing"
    assert tally.longest_message <= MAX_MESSAGE_CHARS, tally.longest_case


def test_tinf_mutants(tmp_path, long_run):
    seed = seed_tinf(tmp_path)
    count = case_count(long_run, CI_TINF_CASES, LONG_TINF_CASES)
    run_and_check(chain([("seed", ("tinf", seed))], tinf_mutants(seed, count, BASE_SEED)), "tinf mutants", count)


def test_hugging_face_checkpoint_mutants(long_run):
    seed = seed_hf_files()
    count = case_count(long_run, CI_CONVERTER_CASES, LONG_CONVERTER_CASES, override=False)
    run_and_check(chain([("seed", ("hf", seed))], hf_mutants(seed, count, BASE_SEED)), "hf mutants", count)


def test_gguf_mutants(long_run):
    seed = seed_gguf()
    count = case_count(long_run, CI_CONVERTER_CASES, LONG_CONVERTER_CASES, override=False)
    run_and_check(chain([("seed", ("gguf", seed))], gguf_mutants(seed, count, BASE_SEED)), "gguf mutants", count)
