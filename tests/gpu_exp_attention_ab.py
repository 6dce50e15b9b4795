"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_attention_ab.py [SHAPE[:QUANT] ...]`; not part of
the test suite): edits of attention_mma's loads around its PDL wait, compared inside the whole decode
step (one process and tuning, rounds alternated), with every version's logits checked against the
package's kernel over 12 positions. Versions (BENCHMARKS.md s33):

- `main`: the package's kernel, which loads the position's two RoPE table rows before the wait;
- `rope_after_wait`: those rows read after the wait with q, k and v, as before s33 (there with
  ld.global.cg, here with __ldg);
- `plain_qkv`: q, k and v read with plain L1-cached loads (asm volatile, ordered after the wait)
  instead of ld.global.cg: the 8 warps of a block read the same q, which then comes from L1 after the
  first warp's miss;
- `kv_where_needed`: k and v (this step's row) read only by the lanes that hold row pos in its pass or
  write it to the cache (4 + 4 lanes), q by every lane: a third of the loads after the wait."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_exp_chain import edited_attention, print_in_turn, random_backend, timed_in_turn  # noqa: E402

ROUNDS = 4
ROPE_EARLY = """    float c[PIECES / 2][8], s[PIECES / 2][8];
    load_rope_row<PIECES>(rope_cos + (size_t)pos * (HD / 2), t, c);
    load_rope_row<PIECES>(rope_sin + (size_t)pos * (HD / 2), t, s);
"""
QKV_LOADS = """        load8_activation(q_head + 32 * i, q[i]);
        load8_activation(k_now + 32 * i, k[i]);
        load8_activation(v_now + 32 * i, v[i]);
    }
"""
ROPE_AFTER_WAIT = [(ROPE_EARLY, ""), (QKV_LOADS, QKV_LOADS + ROPE_EARLY)]
PLAIN_LOAD = """TI_DEVICE void load8_plain(const float* p, float (&v)[8]) {
    float4 a, b;
    asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];\\n" : "=f"(a.x), "=f"(a.y), "=f"(a.z), "=f"(a.w) : "l"(p) : "memory");
    asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];\\n" : "=f"(b.x), "=f"(b.y), "=f"(b.z), "=f"(b.w) : "l"(p + 4) : "memory");
    unpack8(a, b, v);
}

template <int HD>
TI_DEVICE void attention_mma_body("""
PLAIN_QKV = [("template <int HD>\nTI_DEVICE void attention_mma_body(", PLAIN_LOAD),
             (QKV_LOADS, QKV_LOADS.replace("load8_activation", "load8_plain"))]
KV_WHERE_NEEDED = [(QKV_LOADS, """        load8_activation(q_head + 32 * i, q[i]);
        if (holds_new) {
            load8_activation(k_now + 32 * i, k[i]);
            load8_activation(v_now + 32 * i, v[i]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) k[i][e] = v[i][e] = 0.f;
        }
    }
"""), ("""    float q[PIECES][8], k[PIECES][8], v[PIECES][8];
""", """    float q[PIECES][8], k[PIECES][8], v[PIECES][8];
    const int pos_pass = pos - pos % (S * PASS_ROWS);
    bool holds_new = slice == 0 && warp == 0 && g == 0;
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b)
#pragma unroll
        for (int n = 0; n < 2; ++n) holds_new |= row_of(pos_pass, b, n) == pos;
""")]
VERSIONS = {"main": [], "rope_after_wait": ROPE_AFTER_WAIT, "plain_qkv": PLAIN_QKV, "kv_where_needed": KV_WHERE_NEEDED}


def compare(shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        if not b.attn_plan.kernel.startswith("attention_mma"):
            print(f"  {shape}: attention kernel {b.attn_plan.kernel}, not attention_mma: skipped")
            return
        package = b.attn_module
        steps, first = {}, None
        for label, edits in VERSIONS.items():
            b.attn_module = edited_attention(b, edits, b.attn_plan.cluster)
            steps[label] = b.build_step(b.tuning)
            b.graph = b.capture(steps[label])          # decode_forward replays b.graph at short positions
            logits = b.decode_forward(prompt[:12], 0)
            first = logits if first is None else first
            print(f"  {label}: logits max |diff| against main {float(np.abs(logits - first).max()):.3g}", flush=True)
        b.attn_module = package
        print_in_turn(timed_in_turn(b, prompt, steps, ROUNDS))


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["tinyllama:f16"]:
        compare(*(spec.split(":") + ["q4"])[:2])
