"""What each kernel of a decode step really costs, traced by CUPTI.

`ninfer bench --profile` puts a timing event between every two launches, which keeps a kernel
from starting before the one ahead has finished: with dependent launch (a kernel's blocks start
and fetch their weights while the kernel ahead still runs) that profile adds ~2.7 µs per launch
and hides the overlap. This script replays the decode step exactly as the engine does (the
CUDA graph, no events) under torch.profiler, whose CUPTI trace records every kernel of the
graph with its start and end. A kernel's own duration includes the time its blocks sat waiting
for the one ahead, so each launch is charged what it adds to the step: its end minus the latest
end before it (never negative). The charges of a step add up to the step's time on the GPU.

Needs torch with CUDA (for its profiler) and a CUDA build of ninfer.

    python scripts/decode_trace.py ARTIFACT [--prompt 512] [--steps 32] [--json OUT] [--eager]
                                   [--concurrency C] [--pairs] [--max-context N]

`--eager` replays the step as launches from the host instead of its CUDA graph (the same
kernels, with dependent launch), to tell what the graph changes in a kernel's cost.
`--concurrency C` traces the steps of C requests decoding together (C greedy requests of
`--steps` tokens after `--prompt`-token prompts, through `Engine` as `ninfer bench`'s tg128 xC
runs them, after one untraced round). Passes that walk a prompt segment are set aside, and
steps are kept by their launch count, as for one sequence, so a step of fewer rows that runs
the same launches (the same kernels' row buckets) is counted with the steps of all C rows.
`--max-context N` sizes the engine for N positions (default: the prompt, the steps and 16);
pass `ninfer.bench.engine_context(...)` of a bench's figures to trace the step that bench
times: a decode step's CUDA graph covers a KV bucket (the positions rounded up to a power of
two, at most the engine's context), and decode attention's splits follow the bucket.
`--pairs` also prints each kernel's mean charge a launch by the kernel launched before it (the
JSON always has it): the one-token gate_up behind the GDN output projection and behind
attention's o projection, say.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile

import numpy as np

# Launches of one step follow each other by a few microseconds; between two steps the host reads
# the token back, which takes longer than this.
STEP_GAP_US = 15.0


def trace(artifact: str, prompt: int, steps: int, max_context: int, graphs: bool = True) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ninfer import _core

    torch.cuda.init()
    runner = _core.Runner(artifact, device="cuda", max_slots=1, max_context=max_context, cuda_graphs=graphs)
    vocab = json.loads(_core.Artifact(artifact).header_json())["components"]["text"]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, min(vocab, 150000), prompt).tolist()
    slot = runner.alloc_slot()
    tok = runner.step_argmax(slot, ids)
    for _ in range(4):  # capture the graph and warm the caches outside the trace
        tok = runner.step_argmax(slot, [tok])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = runner.step_argmax(slot, [tok])
    runner.free_slot(slot)
    return kernel_events(prof)


def trace_engine(artifact: str, prompt: int, steps: int, concurrency: int, max_context: int) -> list[dict]:
    """The kernels of `concurrency` greedy requests decoding together through `Engine`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ninfer import Engine
    from ninfer.bench import decode_streams

    torch.cuda.init()
    engine = Engine(artifact, device="cuda", max_concurrency=concurrency, max_context=max_context)
    vocab = min(engine.config["vocab_size"], 150000)
    decode_streams(engine, concurrency, prompt, steps, vocab, 0)  # capture the graphs and warm the caches outside the trace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_streams(engine, concurrency, prompt, steps, vocab, 1000)
    engine.close()
    return kernel_events(prof)


def kernel_events(prof) -> list[dict]:
    """The profiler's kernel events, in start order."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


# A pass that runs this walks a segment of GDN_CHUNK_MIN (12) or more tokens: a prompt pass, or
# one that mixes a prompt with decode rows, never a decode step.
PROMPT_KERNEL = "ninfer_gdn_chunked"


def split_steps(kernels: list[dict]) -> list[list[dict]]:
    """The traced kernels cut into steps at the host gaps; of the passes without a prompt
    segment, those of the usual length. C requests started together prefill in passes of as
    many launches each, whose count can be the trace's most common (it was at 16 requests of
    512 tokens and 24 steps), so prompt passes are set aside first."""
    steps, cur, end = [], [], None
    for k in kernels:
        if cur and k["ts"] - end > STEP_GAP_US:
            steps.append(cur)
            cur = []
        cur.append(k)
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    if cur:
        steps.append(cur)
    steps = [s for s in steps if not any(k["name"] == PROMPT_KERNEL for k in s)]
    if not steps:
        return []
    usual = statistics.mode(len(s) for s in steps)
    return [s for s in steps if len(s) == usual]


def charge(step: list[dict]) -> list[tuple[str, float]]:
    """(kernel name, µs it adds to the step) per launch, in launch order."""
    out, end = [], step[0]["ts"]
    for k in step:
        e = k["ts"] + k["dur"]
        out.append((k["name"], max(0.0, e - end)))
        end = max(end, e)
    return out


def by_predecessor(steps: list[list[dict]]) -> list[tuple[str, str, float, float]]:
    """(kernel, the kernel launched before it, launches per step, mean µs charged a launch): a
    kernel's cost can depend on what runs ahead of it (what it overlaps under dependent launch,
    which blocks hold the SMs as it starts), so one name's launches are told apart by their
    predecessor, largest charge per step first."""
    per = collections.defaultdict(lambda: [0, 0.0])
    for s in steps:
        prev = "(step start)"
        for name, c in charge(s):
            per[(name, prev)][0] += 1
            per[(name, prev)][1] += c
            prev = name
    n = len(steps)
    rows = [(name, prev, v[0] / n, v[1] / v[0]) for (name, prev), v in per.items()]
    return sorted(rows, key=lambda r: -r[2] * r[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", help="write the per-kernel table here as JSON")
    ap.add_argument("--eager", action="store_true", help="launch the step's kernels from the host, not as its CUDA graph")
    ap.add_argument("--concurrency", type=int, default=1, help="trace C requests decoding together, through Engine")
    ap.add_argument("--pairs", action="store_true", help="also print each kernel's charge by the kernel launched before it")
    ap.add_argument("--max-context", type=int, help="size the engine for this many positions (default: prompt + steps + 16)")
    a = ap.parse_args()
    if a.concurrency > 1 and a.eager:
        raise SystemExit("--eager traces one sequence (leave --concurrency at 1)")
    ctx = a.max_context or a.prompt + a.steps + 16
    if ctx < a.prompt + a.steps + 1:
        raise SystemExit(f"--max-context {ctx} holds no {a.prompt}-token prompt and {a.steps} steps")
    kernels = (trace_engine(a.artifact, a.prompt, a.steps, a.concurrency, ctx) if a.concurrency > 1
               else trace(a.artifact, a.prompt, a.steps, ctx, graphs=not a.eager))
    steps = split_steps(kernels)
    if not steps:
        raise SystemExit("no decode steps in the trace")
    spans = [s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"] for s in steps]
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])  # launches, charged µs, own µs per step
    for s in steps:
        for (name, c), k in zip(charge(s), s):
            per[name][0] += 1
            per[name][1] += c
            per[name][2] += k["dur"]
    n = len(steps)
    rows = sorted(((name, v[0] / n, v[1] / n, v[2] / n) for name, v in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    what = f" of {a.concurrency} sequences" if a.concurrency > 1 else " (eager)" if a.eager else ""
    print(f"{n} decode steps{what} after a {a.prompt}-token prompt; step on the GPU: median {statistics.median(spans):.1f} µs, "
          f"{len(steps[0])} launches")
    print(f"{'kernel':<40} {'launches':>8} {'charged µs':>10} {'share':>6} {'own µs':>8}")
    for name, k, c, own in rows:
        print(f"{name:<40} {k:>8.0f} {c:>10.1f} {c / total:>6.1%} {own:>8.1f}")
    print(f"{'total':<40} {sum(r[1] for r in rows):>8.0f} {total:>10.1f}")
    pairs = by_predecessor(steps)
    if a.pairs:
        print(f"\n{'kernel':<40} {'after':<40} {'launches':>8} {'µs a launch':>11}")
        for name, prev, k, c in pairs:
            print(f"{name:<40} {prev:<40} {k:>8.0f} {c:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": n, "step_us": statistics.median(spans),
                       "kernels": [{"name": r[0], "launches": r[1], "charged_us": r[2], "own_us": r[3]} for r in rows],
                       "pairs": [{"name": r[0], "after": r[1], "launches": r[2], "charged_us_per_launch": r[3]} for r in pairs]},
                      f, indent=1)


if __name__ == "__main__":
    main()
