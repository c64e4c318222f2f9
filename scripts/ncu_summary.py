"""What bounds each profiled launch, from the raw metrics that scripts/gpu_ncu.sh exports
(`ncu --import REP --page raw --csv`: a header row of metric names, a row of units, one row a
launch): its duration, the warp instructions it executed and how many issue cycles of each
scheduler they take, the fraction of active cycles in which a scheduler issued, DRAM
throughput, achieved occupancy, and the stall reasons that hold its warps longest (cycles a
warp waits, per instruction issued). Launches of the same kernel are summarised by their
medians.

Usage: python3 scripts/ncu_summary.py NCU_CSV
"""

import csv
import statistics
import sys

DURATION = "gpu__time_duration.sum"
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
INSTRUCTIONS = "inst_executed"  # warp instructions
SMS = "device__attribute_multiprocessor_count"
ISSUE = "smsp__issue_active.avg.pct_of_peak_sustained_active"
DRAM = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
WARPS = "sm__warps_active.avg.pct_of_peak_sustained_active"
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
# A warp that issued is counted as "selected": not a stall.
NOT_STALLS = {"selected"}
SCHEDULERS = 4  # per SM (every architecture ninfer builds for)


def number(text):
    """A metric's value (ncu writes thousands with commas), None where it has none."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(path):
    """Each launch's row as {metric: text}, from the raw CSV, and the duration's unit in µs."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3:
        raise SystemExit(f"{path}: no launches")
    head, units = rows[0], dict(zip(rows[0], rows[1]))
    unit = units.get(DURATION, "")
    if unit not in TO_US:
        raise SystemExit(f"{path}: {DURATION} in unknown unit {unit!r}")
    return [dict(zip(head, row)) for row in rows[2:]], TO_US[unit]


def summary(launch, to_us):
    """The figures of one launch: a dict of numbers, and its stalls largest first."""
    get = lambda m: number(launch.get(m, ""))
    us, inst, sms = get(DURATION), get(INSTRUCTIONS), get(SMS)
    fig = {
        "us": None if us is None else us * to_us,
        "minst": None if inst is None else inst / 1e6,
        "issue_kcycles": None if inst is None or not sms else inst / sms / SCHEDULERS / 1000.0,
        "issue": get(ISSUE),
        "dram": get(DRAM),
        "warps": get(WARPS),
    }
    stalls = {}
    for metric, text in launch.items():
        if metric.startswith(STALL[0]) and metric.endswith(STALL[1]):
            reason = metric[len(STALL[0]) : -len(STALL[1])]
            value = number(text)
            if reason not in NOT_STALLS and value:
                stalls[reason] = value
    return fig, sorted(stalls.items(), key=lambda kv: -kv[1])


def cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    by_kernel = {}
    rows, to_us = launches(argv[1])
    for launch in rows:
        by_kernel.setdefault(launch.get("Kernel Name", "?"), []).append(summary(launch, to_us))
    print(f"{'kernel':<40} {'n':>2} {'us':>7} {'M inst':>7} {'issue kcyc':>10} {'issue %':>7} {'DRAM %':>6} {'warps %':>7}  stalls (cycles per issued instruction)")
    for name, runs in by_kernel.items():
        med = lambda key: None if any(r[0][key] is None for r in runs) else statistics.median(r[0][key] for r in runs)
        reasons = {}
        for _, stalls in runs:
            for reason, value in stalls:
                reasons.setdefault(reason, []).append(value)
        top = sorted(((statistics.median(v), r) for r, v in reasons.items()), reverse=True)[:4]
        print(
            f"{name:<40} {len(runs):>2} {cell(med('us'), '.2f'):>7} {cell(med('minst'), '.3f'):>7} "
            f"{cell(med('issue_kcycles'), '.1f'):>10} {cell(med('issue'), '.1f'):>7} {cell(med('dram'), '.1f'):>6} "
            f"{cell(med('warps'), '.1f'):>7}  " + ", ".join(f"{r} {v:.2f}" for v, r in top)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
