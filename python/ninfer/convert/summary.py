"""What `ninfer inspect` shows about an artifact: metadata, components, resources, the tensor
table and totals by encoding and by component, as a dict (for `--json`) or as text.

The file is read through `ninfer._core.Artifact` (the one reader, DESIGN.md §2); the caller opens
it, so opening errors (bad magic, truncated file) and checksum errors stay the caller's to report.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from ninfer.convert.progress import human_bytes

__all__ = ["summarize", "format_summary"]


def _totals(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, int]]:
    acc: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for r in rows:
        acc[r[key]]["tensors"] += 1
        acc[r[key]]["bytes"] += r["bytes"]
    return dict(sorted(acc.items()))


# Components in the order of docs/format.md §2, any others after them.
_COMPONENT_ORDER = ("text", "mtp", "vision", "proposal")


def _natural(name: str) -> list[str | int]:
    # `layers.2` before `layers.10` (the header stores names in plain string order).
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def summarize(art: Any, label: str, verified: bool = False) -> dict[str, Any]:
    """Describes an opened `ninfer._core.Artifact`; `label` is how the file is named in the
    output, `verified` whether the caller has checked the tensor checksums."""
    header = json.loads(art.header_json())
    rows = [
        {
            "name": name,
            "component": t["component"],
            "encoding": t["encoding"],
            "shape": t["shape"],
            "bytes": sum(p["length"] for p in t["parts"].values()),
        }
        for name, t in sorted(header["tensors"].items(), key=lambda kv: _natural(kv[0]))
    ]
    comps = header.get("components", {})
    order = [c for c in _COMPONENT_ORDER if c in comps] + sorted(c for c in comps if c not in _COMPONENT_ORDER)
    return {
        "file": label,
        "file_bytes": art.file_len(),
        "format": header.get("format"),
        "name": header.get("name"),
        "arch": header.get("arch"),
        "id": art.id(),
        "components": {c: comps[c] for c in order},
        "provenance": header.get("provenance", {}),
        "resources": {n: r["length"] for n, r in header.get("resources", {}).items()},
        "tensors": rows,
        "totals": {
            "tensors": len(rows),
            "bytes": sum(r["bytes"] for r in rows),
            "by_encoding": _totals(rows, "encoding"),
            "by_component": _totals(rows, "component"),
        },
        "verified": verified,
    }


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


def _totals_table(title: str, totals: dict[str, dict[str, int]]) -> list[str]:
    rows = [[k, str(v["tensors"]), str(v["bytes"]), human_bytes(v["bytes"])] for k, v in totals.items()]
    return [title, *_table([title.split()[-1], "tensors", "bytes", ""], rows, {1, 2, 3})]


def format_summary(s: dict[str, Any]) -> str:
    prov = s["provenance"]
    lines = [
        f"file        {s['file']} ({human_bytes(s['file_bytes'])})",
        f"name        {s['name']}",
        f"arch        {s['arch']}",
        f"id          {s['id']}",
        f"format      {s['format']}",
    ]
    if prov:
        lines.append(f"provenance  {json.dumps(prov, ensure_ascii=False)}")
    lines.append("components")
    for comp, cfg in s["components"].items():
        lines.append(f"  {comp}")
        lines.extend(f"    {k}: {json.dumps(v)}" for k, v in cfg.items())
    lines.append("resources" if s["resources"] else "resources   (none)")
    lines.extend(_table(["name", "bytes"], [[n, str(b)] for n, b in s["resources"].items()], {1})[1:])
    lines.append(f"tensors     {s['totals']['tensors']}")
    rows = [[t["name"], t["component"], t["encoding"], str(t["shape"]), str(t["bytes"])] for t in s["tensors"]]
    lines.extend(_table(["name", "component", "encoding", "shape", "bytes"], rows, {4}))
    lines.extend(_totals_table("totals by encoding", s["totals"]["by_encoding"]))
    lines.extend(_totals_table("totals by component", s["totals"]["by_component"]))
    total = s["totals"]
    lines.append(f"total       {total['tensors']} tensors, {total['bytes']} bytes ({human_bytes(total['bytes'])})")
    if s["verified"]:
        lines.append("verify      ok: every tensor checksum matches")
    return "\n".join(lines)
