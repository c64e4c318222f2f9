"""scripts/ncu_summary.py on a small raw-metrics CSV of the shape `ncu --page raw --csv` writes."""

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_summary.py"

HEAD = [
    "ID", "Kernel Name", "gpu__time_duration.sum", "inst_executed", "device__attribute_multiprocessor_count",
    "smsp__issue_active.avg.pct_of_peak_sustained_active", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
]
UNITS = ["", "", "us", "inst", "", "%", "%", "%", "inst", "inst", "inst"]


def run(tmp_path, rows, units=UNITS):
    path = tmp_path / "ncu.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(HEAD)
        w.writerow(units)
        w.writerows(rows)
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)


def test_medians_issue_cycles_and_stalls(tmp_path):
    rows = [
        ["0", "gate_up", "11.0", "4,000,000", "100", "60", "28", "45", "2.0", "3.0", "1.0"],
        ["1", "router", "5.0", "200,000", "100", "30", "5", "12", "0.5", "1.0", "1.0"],
        ["2", "gate_up", "13.0", "4,000,000", "100", "62", "30", "47", "2.4", "2.8", "1.0"],
    ]
    out = run(tmp_path, rows)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    g = lines["gate_up"].split()
    # two launches; median 12 us; 4 M instructions; 4e6 / 100 SMs / 4 schedulers = 10 K cycles
    assert g[1:7] == ["2", "12.00", "4.000", "10.0", "61.0", "29.0"]
    # stalls largest first, "selected" (the issuing warp) left out
    assert lines["gate_up"].endswith("long_scoreboard 2.90, barrier 2.20")
    assert lines["router"].split()[1:3] == ["1", "5.00"]


def test_refuses_an_unknown_duration_unit(tmp_path):
    rows = [["0", "k", "1", "1", "1", "1", "1", "1", "0", "0", "0"]]
    out = run(tmp_path, rows, units=["", "", "cycle"] + UNITS[3:])
    assert out.returncode != 0
    assert "unknown unit" in out.stderr
