"""scripts/decode_trace.py's cutting of a CUPTI kernel trace into decode steps (no GPU needed)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_trace.py"


def load():
    spec = importlib.util.spec_from_file_location("decode_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def events(passes, gap=100.0):
    """Kernel events of passes (lists of kernel names) run back to back, 2 µs a launch, `gap`
    µs of host time between passes."""
    out, ts = [], 0.0
    for names in passes:
        for n in names:
            out.append({"name": n, "ts": ts, "dur": 2.0})
            ts += 2.0
        ts += gap
    return out


def test_prompt_passes_are_not_decode_steps_even_when_more_numerous():
    dt = load()
    prompt = ["ninfer_gemv_q8_g32_bulk_b16", "ninfer_gdn_chunked", "ninfer_moe_gate_up_grouped_nvfp4", "ninfer_sample"]
    decode = ["ninfer_gemv_q8_g32_mma_b16", "ninfer_gdn_recurrent", "ninfer_sample"]
    short = ["ninfer_gemv_q8_g32_mma_b8", "ninfer_sample"]  # fewer rows, other row buckets
    steps = dt.split_steps(events([prompt] * 5 + [short] + [decode] * 3))
    assert len(steps) == 3
    assert all([k["name"] for k in s] == decode for s in steps)


def test_launches_of_one_step_stay_together_and_gaps_split_steps():
    dt = load()
    decode = ["a", "b", "c"]
    ev = events([decode] * 4)
    # A launch that starts inside the one ahead (dependent launch) is still the same step.
    ev[1]["ts"] = ev[0]["ts"] + 1.0
    steps = dt.split_steps(ev)
    assert [len(s) for s in steps] == [3, 3, 3, 3]
    assert dt.split_steps(events([["ninfer_gdn_chunked", "x"]] * 2)) == []


def test_charges_by_predecessor_tell_one_kernels_launches_apart():
    dt = load()
    ev = events([["g", "e", "a", "e"]] * 2)
    # Each step: e after g takes 3 µs more, e after a 1 µs more (their ends move, charges follow).
    for i in (1, 5):
        ev[i]["dur"] = 5.0
        for k in ev[i + 1 : i + 3]:
            k["ts"] += 3.0
    for i in (3, 7):
        ev[i]["dur"] = 3.0
    pairs = {(n, p): (k, c) for n, p, k, c in dt.by_predecessor(dt.split_steps(ev))}
    assert pairs[("e", "g")] == (1.0, 5.0)
    assert pairs[("e", "a")] == (1.0, 3.0)
    assert pairs[("g", "(step start)")] == (1.0, 2.0)
    assert pairs[("a", "e")] == (1.0, 2.0)
