"""`ninfer bench ARTIFACT`: prefill and decode speed through the engine path users run.

Every figure goes through `Engine` (scheduler, backend, sampler), exactly like `Engine.generate`
and the server; nothing times a kernel alone.
- ppN: a request with an N-token prompt and max_tokens 1; prompt tokens over the time to its end.
- tg128: after a 512-token prompt, 128 greedy tokens (EOS ignored); decode tok/s is 127 over the
  time from the first generated token to the last.
- tg128 at c concurrent sequences: c such requests at once; aggregate decode tok/s over the span
  in which all of them are decoding.
Each figure is measured after one warm-up run, `reps` times; the median and the spread (min, max)
are reported. The roofline fraction of a decode figure is the weight bytes one decode step reads
(from the artifact: everything but the token table, the experts a step touches in expectation)
times steps per second over the device's copy bandwidth, which bench measures itself.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ninfer import _core
from ninfer.engine import Engine, SamplingParams

__all__ = ["BenchResult", "KernelTime", "bytes_per_decode_step", "copy_bandwidth", "format_profile", "profile_steps", "run_bench"]


@dataclass
class Figure:
    name: str
    unit: str
    median: float
    low: float
    high: float
    reps: int
    roofline: float | None = None


@dataclass
class BenchResult:
    artifact: str
    device: str
    bandwidth_gb_s: float
    figures: list[Figure] = field(default_factory=list)


def copy_bandwidth(device: str) -> float:
    """Measured copy bandwidth in bytes/s (read + write) of the memory the backend computes from:
    a device-to-device copy of a 1 GiB buffer on a CUDA device, a 256 MiB host copy on the CPU."""
    if device.startswith("cuda"):
        return float(_core.cuda_copy_bandwidth())
    if not device.startswith("cpu"):
        raise ValueError(f"no bandwidth probe for device `{device}`")
    src = np.ones(1 << 28, dtype=np.uint8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t))
    return best


def bytes_per_decode_step(artifact: str, batch: int = 1) -> float:
    """Weight bytes one decode step reads: all text tensors except the token table (one row) and
    the routed expert banks, of which the expected number of distinct experts over `batch` tokens."""
    header = json.loads(_core.Artifact(artifact).header_json())
    cfg = header["components"]["text"]
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    distinct = e * (1 - (1 - k / e) ** batch)
    total = 0.0
    for name, t in header["tensors"].items():
        if t["component"] != "text":
            continue
        nbytes = sum(p["length"] for p in t["parts"].values())
        if name == "embed":
            total += batch * nbytes / t["shape"][0]
        elif ".moe.experts." in name:
            total += nbytes * distinct / e
        else:
            total += nbytes
    return total


def _random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _prefill(engine: Engine, n: int, vocab: int, seed: int) -> float:
    ids = _random_prompt(vocab, n, seed)
    t = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return n / (time.perf_counter() - t)


def decode_streams(engine: Engine, streams: int, prompt: int, tokens: int, vocab: int, seed: int) -> float:
    """Aggregate decode tok/s of `streams` concurrent greedy requests."""
    first, last, counts = [0.0] * streams, [0.0] * streams, [0] * streams

    def one(i: int) -> None:
        for d in engine.stream(_random_prompt(vocab, prompt, seed + i), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
            if d.token_ids:
                now = time.perf_counter()
                if counts[i] == 0:
                    first[i] = now
                last[i] = now
                counts[i] += len(d.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = min(last) - max(first)
    if span <= 0:
        span = max(last) - min(first)
    return sum(c - 1 for c in counts) / span


def engine_context(prefill: tuple[int, ...] = (512, 4096, 16384), tg_prompt: int = 512, tg_tokens: int = 128) -> int:
    """The context run_bench sizes its engine for: its longest prompt, or the tg prompt and its
    tokens, plus 8. The decode graphs' KV buckets, and so decode attention's splits, follow it
    (scripts/decode_trace.py traces in an engine of this size to time the step bench times)."""
    return max(prefill + (tg_prompt + tg_tokens,)) + 8


def run_bench(artifact: str, device: str = "auto", reps: int = 3, prefill: tuple[int, ...] = (512, 4096, 16384),
              concurrency: tuple[int, ...] = (1, 4, 16), tg_prompt: int = 512, tg_tokens: int = 128) -> BenchResult:
    ctx = engine_context(prefill, tg_prompt, tg_tokens)
    engine = Engine(artifact, device=device, max_concurrency=max(concurrency), max_context=ctx, prefill_chunk=max(prefill))
    vocab = min(engine.config["vocab_size"], 150000)
    result = BenchResult(artifact, engine.device, copy_bandwidth(engine.device) / 1e9)

    def measure(name: str, unit: str, fn, bytes_per_step: float | None = None, streams: int = 1) -> None:
        fn(0)  # warm-up
        values = [fn(r + 1) for r in range(reps)]
        med = statistics.median(values)
        roof = None
        if bytes_per_step is not None:
            steps_per_s = med / streams
            roof = bytes_per_step * steps_per_s / (result.bandwidth_gb_s * 1e9)
        result.figures.append(Figure(name, unit, med, min(values), max(values), reps, roof))

    try:
        for n in prefill:
            measure(f"pp{n}", "tok/s", lambda s, n=n: _prefill(engine, n, vocab, s))
        for c in concurrency:
            label = f"tg{tg_tokens}" + (f" @{tg_prompt}" if tg_prompt != 512 else "") + (f" x{c}" if c > 1 else "")
            measure(label, "tok/s", lambda s, c=c: decode_streams(engine, c, tg_prompt, tg_tokens, vocab, 1000 * s), bytes_per_decode_step(artifact, c), c)
    finally:
        engine.close()
    return result


def format_result(r: BenchResult) -> str:
    lines = [f"ninfer bench {r.artifact} on {r.device} (copy bandwidth {r.bandwidth_gb_s:.1f} GB/s)",
             f"{'test':<12} {'median':>12} {'min':>12} {'max':>12}  {'roofline':>8}"]
    for f in r.figures:
        roof = f"{f.roofline:.3f}" if f.roofline is not None else "-"
        lines.append(f"{f.name:<12} {f.median:>12.1f} {f.low:>12.1f} {f.high:>12.1f}  {roof:>8}   {f.unit}, {f.reps} reps")
    return "\n".join(lines)


@dataclass
class KernelTime:
    """One label of a profiled decode step, averaged over the profiled steps."""

    label: str
    launches: float
    ms: float
    bytes: float

    @property
    def gb_s(self) -> float:
        return self.bytes / (self.ms * 1e6) if self.ms > 0 else 0.0


def _aggregate(runs: list[list[tuple[str, float, int]]]) -> list[KernelTime]:
    """Per label, the mean launches, milliseconds and bytes over `runs`, in order of first launch."""
    totals: dict[str, list[float]] = {}
    for run in runs:
        for label, ms, nbytes in run:
            t = totals.setdefault(label, [0.0, 0.0, 0.0])
            t[0] += 1
            t[1] += ms
            t[2] += nbytes
    n = len(runs)
    return [KernelTime(label, k / n, ms / n, b / n) for label, (k, ms, b) in totals.items()]


def profile_steps(artifact: str, device: str = "cuda", prompt: int = 512, steps: int = 8) -> dict[str, list[KernelTime]]:
    """Where a step spends its time, kernel by kernel: the `prompt`-token prefill of a random
    prompt ("prefill", one step) and the `steps` greedy batch-1 decode steps after it ("decode",
    their mean), with CUDA events between launches (the backend's `profile_step`). A throwaway
    prompt and decode step first load the modules and fill the caches. The prefill runs eagerly
    and pays host launch gaps; a decode step is a CUDA graph with the events as nodes in it,
    which keep each launch from overlapping the one ahead, so its sum exceeds the step's time in
    the engine by about a launch latency per launch."""
    runner = _core.Runner(artifact, device=device, max_slots=2, max_context=prompt + steps + 8)
    vocab = json.loads(_core.Artifact(artifact).header_json())["components"]["text"]["vocab_size"]
    ids = _random_prompt(min(vocab, 150000), prompt, 0)
    warm = runner.alloc_slot()
    runner.profile_step(warm, [runner.step_argmax(warm, ids)])
    runner.free_slot(warm)
    slot = runner.alloc_slot()
    prefill = runner.profile_step(slot, ids)
    tok, decode = ids[-1], []
    for _ in range(steps):
        decode.append(runner.profile_step(slot, [tok]))
        tok = (tok + 1) % vocab
    runner.free_slot(slot)
    return {"prefill": _aggregate([prefill]), "decode": _aggregate(decode)}


def format_profile(times: list[KernelTime], bandwidth_gb_s: float) -> str:
    total_ms = sum(t.ms for t in times)
    total_b = sum(t.bytes for t in times)
    lines = [f"{'kernel':<20} {'launches':>8} {'us/step':>9} {'share':>6} {'MB/step':>9} {'GB/s':>7} {'of copy bw':>10}"]
    for t in sorted(times, key=lambda t: -t.ms):
        frac = f"{t.gb_s / bandwidth_gb_s:.2f}" if t.bytes else "-"
        gbs = f"{t.gb_s:.0f}" if t.bytes else "-"
        lines.append(f"{t.label:<20} {t.launches:>8.0f} {t.ms * 1e3:>9.1f} {t.ms / total_ms:>6.1%} {t.bytes / 1e6:>9.2f} {gbs:>7} {frac:>10}")
    lines.append(f"{'total':<20} {sum(t.launches for t in times):>8.0f} {total_ms * 1e3:>9.1f} {1:>6.0%} {total_b / 1e6:>9.2f} {total_b / (total_ms * 1e6):>7.0f}")
    return "\n".join(lines)
