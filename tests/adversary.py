"""The adversarial harness: untrusted inputs run in child processes with a time and a memory limit.

A WorkerPool keeps a few long-lived workers (this file run as a script). Each limits its address space
to MEMORY_LIMIT with setrlimit, then reads cases from its stdin and answers with one outcome per case:
  ok       the input was accepted and used (loaded and generated from, or converted and loaded)
  project  a TinyInferError (the project's own one-sentence error)
  leak     any other exception (a failure: a raw Python error reached the user)
and the parent adds
  hang     no answer within the case's time limit (the worker is killed and replaced)
  crash    the worker died (abort, segfault, or killed for memory)
A case is (target, payload): "tinf" (the bytes of a .tinf file), "hf" ({file name: bytes} of a Hugging
Face checkpoint folder), "llama2c" (the bytes of a .bin; a tokenizer is added), "gguf" (the bytes of a
.gguf file). Every accepted input is exercised the way a user would: tinyrun info --check, load on the
CPU, a plain and a chat generation; converted files are loaded and exercised too.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_LIMIT = 2 << 30
CASE_SECONDS = 30.0        # above the chat template's own compile and render limits (5 s each)
OUTCOMES = ("ok", "project", "leak", "hang", "crash")
FAILURES = ("leak", "hang", "crash")
HERE = Path(__file__).resolve().parent
# One thread per library and few malloc arenas: the address-space limit counts reserved memory too.
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2", "HF_HUB_OFFLINE": "1"}


@dataclass
class Result:
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


@dataclass
class Tally:
    """Outcome counts over a run, with the first few failures kept for the report."""

    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    failures: list = field(default_factory=list)
    longest_message: int = 0
    peak_rss_mb: float = 0.0
    outcomes: dict = field(default_factory=dict)   # case name -> outcome
    longest_case: tuple = ()                        # (name, start of the message) of the longest error

    def add(self, name: str, result: Result) -> None:
        self.counts[result.outcome] += 1
        self.outcomes[name] = result.outcome
        self.peak_rss_mb = max(self.peak_rss_mb, result.peak_rss_mb)
        if result.outcome == "project" and len(result.detail) > self.longest_message:
            self.longest_message, self.longest_case = len(result.detail), (name, result.detail[:300])
        if result.outcome in FAILURES and len(self.failures) < 20:
            self.failures.append((name, result.outcome, result.detail[:300]))

    def failed(self) -> int:
        return sum(self.counts[o] for o in FAILURES)


# ------------------------------------------------------------------------------------------ parent


def send(stream, message) -> None:
    blob = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (length,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(length))


class Worker:
    def __init__(self):
        env = {**os.environ, **WORKER_ENV, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def run(self, case, timeout: float) -> Result:
        started = time.monotonic()
        try:
            send(self.proc.stdin, case)
        except (BrokenPipeError, OSError):
            return Result("crash", f"the worker was gone (exit {self.proc.poll()})")
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            return Result("hang", f"no answer in {timeout:.0f} s", time.monotonic() - started)
        try:
            return Result(*receive(self.proc.stdout))   # sent as a tuple: the worker's classes are __main__'s
        except (EOFError, pickle.UnpicklingError):
            code = self.proc.wait(timeout=10)
            return Result("crash", f"the worker died (exit status {code})", time.monotonic() - started)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    """`with WorkerPool(n) as pool: tally = pool.run_all(named_cases)`: cases spread over n workers;
    a worker that hangs or dies is replaced before its next case."""

    def __init__(self, size: int = 2, timeout: float = CASE_SECONDS):
        self.size, self.timeout = size, timeout
        self.workers: list[Worker] = []

    def __enter__(self):
        self.workers = [Worker() for _ in range(self.size)]
        return self

    def __exit__(self, *exc):
        for worker in self.workers:
            try:
                worker.proc.stdin.close()
            except OSError:
                pass
            worker.kill()
        return False

    def run_all(self, named_cases) -> Tally:
        tally, pending, lock, broken = Tally(), iter(named_cases), threading.Lock(), []

        def serve(index: int) -> None:
            while True:
                with lock:
                    try:
                        item = next(pending, None)
                    except Exception as e:   # a bug in a mutator: the run must fail, not end early
                        broken.append(e)
                        item = None
                if item is None:
                    return
                name, case = item
                if not self.workers[index].alive():
                    self.workers[index] = Worker()
                result = self.workers[index].run(case, self.timeout)
                if result.outcome in ("hang", "crash"):
                    self.workers[index].kill()
                with lock:
                    tally.add(name, result)

        threads = [threading.Thread(target=serve, args=(i,)) for i in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if broken:
            raise broken[0]
        return tally


# ------------------------------------------------------------------------------------------ worker


def exercise_tinf(path: Path) -> None:
    """What a user does with a file: tinyrun info (--check), then load it and generate (plain and chat)."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime.cli import describe
    from tinyinfer.runtime.integrity import IntegrityError, check_file
    from tinyinfer.runtime.model import check_model, load

    with open_tinf(path) as f:   # tinyrun info
        check_model(f)
        describe(f, per_tensor=True)
    corrupt = None
    try:
        check_file(path, progress=False)
    except IntegrityError as e:   # a user who never runs --check loads it anyway: so does the harness
        corrupt = e
    with load(path, device="cpu", weight_cache_bytes=64 << 20) as model:
        "".join(model.generate("w3 w4 hello", max_tokens=3))
        "".join(model.generate("w5", max_tokens=2, temperature=0.8, seed=1))
        if model.chat_template:
            "".join(model.generate([{"role": "user", "content": "w3 w4"}], max_tokens=2))
    if corrupt is not None:
        raise corrupt


def convert_and_exercise(source: Path, out: Path, **kwargs) -> None:
    from tinyinfer.convert import convert_checkpoint

    convert_checkpoint(source, out, quant="q8", progress=False, **kwargs)
    exercise_tinf(out)


def run_case(case, scratch: Path) -> None:
    target, payload = case
    for old in scratch.iterdir():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if target == "tinf":
        path = scratch / "model.tinf"
        path.write_bytes(payload)
        exercise_tinf(path)
    elif target == "hf":
        folder = scratch / "checkpoint"
        folder.mkdir()
        for name, data in payload.items():
            (folder / name).write_bytes(data)
        convert_and_exercise(folder, scratch / "out.tinf")
    elif target == "llama2c":
        binary, tokenizer = payload
        (scratch / "model.bin").write_bytes(binary)
        (scratch / "tok.model").write_bytes(tokenizer)
        convert_and_exercise(scratch / "model.bin", scratch / "out.tinf", tokenizer=scratch / "tok.model")
    elif target == "gguf":
        (scratch / "model.gguf").write_bytes(payload)
        convert_and_exercise(scratch / "model.gguf", scratch / "out.tinf")
    else:
        raise ValueError(f"unknown target {target!r}")


def worker_main() -> None:
    import resource

    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # libraries that print cannot corrupt the protocol
    sys.stdout = open(os.devnull, "w")
    requests = os.fdopen(0, "rb")
    import numpy  # noqa: F401  (imports before the limit: what a worker maps once is not a case's)

    import tinyinfer.convert.pipeline  # noqa: F401
    import tinyinfer.runtime.model  # noqa: F401
    from tinyinfer.formats import TinyInferError

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    with tempfile.TemporaryDirectory(prefix="adversary-") as scratch:
        while True:
            try:
                case = receive(requests)
            except EOFError:
                return
            started = time.monotonic()
            try:
                run_case(case, Path(scratch))
                result = Result("ok")
            except TinyInferError as e:
                result = Result("project", str(e))
            except BaseException as e:   # noqa: B036 (a PanicException or MemoryError is what we look for)
                if isinstance(e, KeyboardInterrupt):
                    raise
                result = Result("leak", f"{type(e).__name__}: {str(e)[:200]}")
            result.seconds = time.monotonic() - started
            result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            send(protocol, (result.outcome, result.detail, result.seconds, result.peak_rss_mb))


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker_main()
