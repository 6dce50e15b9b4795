"""Run by hand on a GPU (`python3 tests/perf/graph_ab.py A B [C ...] SHAPE[:QUANT] ...`): versions of the kernel
sources compared inside the whole decode step. A version is a gemv.cu file, or a folder holding any of the
package's kernel sources (gemv.cu, mlp.cu, common.cuh, ...), which replace the package's own; the rest come
from the package. For each random-weight model (tuned with the package's sources), each version builds every
kernel of the step that includes gemv.cu: the tuned GEMVs, the variants that read the fused step's fixed-point
residual, and the fused MLP (mlp.cu includes gemv.cu). The steps are then timed in turn, ROUNDS times each
(the order reversed every other round); prints each version's range and median us per token, and its change
from the first. Alternating in one process keeps every version on the same machine, clocks and tuned
configurations."""
import sys
from pathlib import Path

from chain import print_in_turn, random_backend, step_with, timed_in_turn

ROUNDS = 4


def compare(paths: list, shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        package_module = b.gemv_module
        steps = {path: step_with(b, path) for path in paths}
        b.gemv_module = package_module
        print_in_turn(timed_in_turn(b, prompt, steps, ROUNDS), lambda path: Path(path).name)


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if Path(a).exists()]
    specs = [a for a in sys.argv[1:] if not Path(a).exists()]
    for spec in specs or ["tinyllama", "llama2-7b"]:
        compare(paths, *(spec.split(":") + ["q4"])[:2])
