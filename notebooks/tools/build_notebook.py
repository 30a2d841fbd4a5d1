"""Writes notebooks/cache_engineering.ipynb (run from the repo root); edit here, not the .ipynb."""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
nb.cells = [
md("""# Cache engineering with akv_jax

Drives jit-compiled `append` / `drop` / `repos` on a tiny random model (DESIGN.md §2):
the paper's Figure 5 (same tokens, three different states), Figure 10 (positions), one-pass
restore equal to the incremental path, and how decode attention work falls with the active
fraction. The test suite executes this notebook (`tests/test_notebook.py`)."""),
code("""import jax.numpy as jnp
import numpy as np

from akv_jax.cache.core import CacheOps, restore
from akv_jax.cache.ops import parse_history
from akv_jax.model.config import tiny_config
from akv_jax.model.params import seeded_params

cfg = tiny_config("qwen3")
params = seeded_params(cfg, 0)
ops = CacheOps(cfg, block_q=16, page_size=16)   # jit-compiled ops bound to this model
CAP = 256"""),
md("""## Figure 5: same final tokens, three different states
A,B,C then drop A; A,B, drop A, then C; B,C from scratch. Layer-0 keys of C only differ by
position; deeper layers remember what C attended to."""),
code("""A, B, C = [3, 4, 5, 6], [7, 8, 9], [10, 11, 12]
paths = {
    "A,B,C | drop A": ([A, B, C], {"drop": {"2": [0]}}),
    "A,B | drop A | C": ([A, B, C], {"drop": {"1": [0]}}),
    "B,C": ([B, C], {}),
}
c_kv = {}
for name, (segs, cache) in paths.items():
    _, st = ops.run(params, ops.empty(CAP), segs, parse_history(cache, len(segs)))
    k, v = st.slot_keys()
    T = int(st.length)
    c_kv[name] = np.concatenate(
        [np.asarray(k[:, T - 3 : T]).ravel(), np.asarray(v[:, T - 3 : T]).ravel()]
    )
names = list(c_kv)
pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
diffs = {(a, b): float(np.abs(c_kv[a] - c_kv[b]).max()) for a, b in pairs}
for pair, d in diffs.items():
    print(f"{pair[0]:>18} vs {pair[1]:<18} max |dKV| = {d:.3e}")
assert min(diffs.values()) > 1e-3"""),
md("""## Figure 10: positions
A0 B1 C2 | drop B, repos → A0 C1 | D2 | drop D → E3 (drop alone does not compact)
| repos → A0 C1 E2 | F3."""),
code("""names = "ABCDEF"
segs = [[20 + i] for i in range(6)]
hist = parse_history({"drop": {"2": [1], "3": [3]}, "reposition": [2, 4]}, 6)
st = ops.empty(CAP)
trace = []
def show(st, upto):
    pos, act = np.asarray(st.positions), np.asarray(st.active)
    return " ".join(f"{names[i]}{pos[i]}" for i in range(upto) if act[i])
for s, seg in enumerate(segs):
    _, st = ops.append(params, st, seg)
    seen = show(st, s + 1)  # what segment s attended to, at the positions it saw
    if hist.drops_at(s):
        st = ops.drop(st, list(hist.drops_at(s)))
    if hist.repos_at(s):
        st = ops.repos(st)
    trace.append((seen, show(st, s + 1)))
    print(f"{names[s]} saw: {seen:<14} after boundary {s}: {trace[-1][1]}")
assert trace[2][1] == "A0 C1"
assert trace[3][0] == "A0 C1 D2"
assert trace[4][0] == "A0 C1 E3" and trace[4][1] == "A0 C1 E2"
assert trace[5][0] == "A0 C1 E2 F3"
# E was computed at position 3 (it saw A0 C1 E3); the repos at boundary 4 re-encoded it to 2."""),
md("""## One-pass restore equals the incremental path
A random 10-segment history with middle drops and two repositions, computed op by op and in
one forward pass (queries split at boundaries, each over the position version it saw)."""),
code("""rng = np.random.default_rng(0)
segs = [rng.integers(0, cfg.vocab_size, size=int(rng.integers(3, 20))).tolist() for _ in range(10)]
hist = parse_history({"drop": {"3": [1], "5": [2, 4], "8": [0]}, "reposition": [5, 8]}, 10)
inc_logits, inc_state = ops.run(params, ops.empty(CAP), segs, hist)
one_logits, one_state = restore(params, cfg, segs, hist, max_tokens=CAP, block_q=16)
T = int(inc_state.length)
dlog = float(jnp.abs(inc_logits - one_logits).max())
dk = float(jnp.abs(inc_state.slot_keys()[0][:, :T] - one_state.slot_keys()[0][:, :T]).max())
print(f"max |logit diff| = {dlog:.2e}, max |K diff| = {dk:.2e}")
assert dlog < 1e-4 and dk < 1e-5"""),
md("""## Decode attention work against the active fraction
The segment-batch kernels skip every page with no visible token, so a decode step reads only
the pages that still hold active KV. Below: pages a decode query reads, for a 4096-token context
of 64 messages of which a growing share is dropped (a rolling-drop agent drops whole tool
responses, so dropped KV comes in whole pages). Measured kernel timings on an accelerator are
in `bench/kernels.py` and `bench/decode_attention.py`."""),
code("""import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from akv_jax.pallas.metadata import SegmentSpec, build_segment_batch  # noqa: E402

page, n_msgs, msg_len = 16, 64, 64
fractions, pages_read = [], []
for n_drop in range(0, n_msgs, 8):
    dropped = set(np.random.default_rng(n_drop).choice(n_msgs - 1, n_drop, replace=False))
    visible = np.concatenate([np.full(msg_len, m not in dropped) for m in range(n_msgs)])
    spec = SegmentSpec(q_start=0, q_len=1, pages=list(range(len(visible) // page)),
                       kv_visible=visible, causal_pos=len(visible) - 1)
    batch = build_segment_batch([spec], page_size=page, block_q=1)
    fractions.append(visible.mean())
    pages_read.append(int(np.asarray(batch.page_visible).sum()))
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(fractions, pages_read, "o-")
ax.set_xlabel("active fraction of KV")
ax.set_ylabel("pages read per decode query")
ax.set_title("decode attention work vs active KV")
fig.tight_layout()
print(list(zip(np.round(fractions, 3), pages_read, strict=True)))
assert pages_read == sorted(pages_read, reverse=True)
assert abs(pages_read[-1] / pages_read[0] - fractions[-1]) < 0.02"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "notebooks/cache_engineering.ipynb")
