"""`convert`: a Hugging Face checkpoint directory -> one `.ninfer` artifact plus its records.

Steps: open the source, resolve the config, plan every logical tensor and decide its encoding from
headers alone (so shape and group-size errors come before anything is written), then stream one
tensor at a time into the artifact writer, add the resources, and finally write
`<name>.conversion.json` and the artifact's line in `SHA256SUMS` next to it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ninfer import __version__, _core
from ninfer.convert.encode import encode, resolve_target
from ninfer.convert.mapping import has_mtp, plan_tensors
from ninfer.convert.progress import Progress
from ninfer.convert.recipes import KEEP, RECIPES
from ninfer.convert.source import ConvertError, open_source, resolve_text_config

__all__ = ["convert", "COMPONENTS", "conversion_json_path"]

ARCH = "qwen3_5_moe"
COMPONENTS = ("text", "mtp", "vision")


def conversion_json_path(artifact: Path) -> Path:
    """`model.ninfer` -> `model.conversion.json` (any other name gets the suffix appended)."""
    stem = artifact.name[: -len(".ninfer")] if artifact.name.endswith(".ninfer") else artifact.name
    return artifact.with_name(stem + ".conversion.json")


def _components(requested: list[str] | None, mtp_available: bool) -> list[str]:
    if requested is None:
        return ["text", "mtp"] if mtp_available else ["text"]
    comps = [c.strip() for c in requested if c.strip()]
    unknown = [c for c in comps if c not in COMPONENTS]
    if unknown:
        raise ConvertError(f"unknown component(s) {', '.join(unknown)} (known: {', '.join(COMPONENTS)})")
    if "vision" in comps:
        raise ConvertError("the vision component is not implemented yet; use --components text or text,mtp")
    if "text" not in comps:
        raise ConvertError("the text component is required")
    if "mtp" in comps and not mtp_available:
        raise ConvertError(
            "component mtp was requested but the checkpoint has no mtp.* tensors (or mtp_num_hidden_layers is 0)"
        )
    return [c for c in ("text", "mtp") if c in comps]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _record_sha256(artifact: Path, digest: str) -> Path:
    """Adds `<digest>  <file name>` to SHA256SUMS, replacing a stale line for the same name."""
    sums = artifact.parent / "SHA256SUMS"
    lines = sums.read_text(encoding="utf-8").splitlines() if sums.is_file() else []
    # A line is `<digest>  <name>` (text mode) or `<digest> *<name>` (binary mode).
    kept = [ln for ln in lines if ln.split(None, 1)[1:] not in ([artifact.name], ["*" + artifact.name])]
    kept.append(f"{digest}  {artifact.name}")
    tmp = sums.with_name(sums.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
    tmp.replace(sums)
    return sums


def _report_json(report: dict[str, Any]) -> str:
    """Indented JSON with one line per tensor, so the file stays readable for a full model."""
    lines = []
    for key, value in report.items():
        if key == "tensors":
            rows = [f"  {json.dumps(n)}: {json.dumps(t)}" for n, t in value.items()]
            lines.append(f' "tensors": {{\n' + ",\n".join(rows) + "\n }")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _skipped_warning(skipped: list[str], comps: list[str], tied: bool) -> str | None:
    # Vision weights, MTP weights of a text-only conversion and a tied model's unused lm_head are
    # expected leftovers; anything else suggests a layout this converter does not know.
    def expected(n: str) -> bool:
        return (
            n.startswith("model.visual.")
            or (n.startswith("mtp.") and "mtp" not in comps)
            or (tied and n.startswith("lm_head."))
        )

    odd = [n for n in skipped if not expected(n)]
    if not odd:
        return None
    shown = ", ".join(odd[:5]) + (", ..." if len(odd) > 5 else "")
    return f"{len(odd)} source tensor(s) were not converted: {shown}"


def convert(
    src: str | Path,
    out: str | Path,
    recipe: str = "bf16",
    components: list[str] | None = None,
    *,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Converts the HF checkpoint directory `src` into the artifact `out`; returns the report.

    `out` may be an existing directory: the file is then `<model>.<recipe>.ninfer` in it (model =
    the directory name, or `Name` for a hub cache snapshot of `Org/Name`). `components` defaults
    to text, plus mtp when the checkpoint has an MTP block; `name` is the model name stored in the
    artifact (default: that model name). With `progress` the progress line and the warnings go to
    stderr. Raises `ConvertError` for every problem with the input (the message names the file or
    tensor); the artifact, `<stem>.conversion.json` and the `SHA256SUMS` line appear only on success.

    The report is what `conversion.json` holds: `recipe`, `source` ({`path`: directory name,
    `revision` when recorded}), `artifact` (file name), `sha256`, `components`, `tensors`
    ({logical name: {`sources`: HF tensor names in row order, `encoding`, `shape`, `bytes`}},
    in file order), `totals` ({`tensors`, `bytes`, `bytes_by_encoding`}), `resources`, `skipped`
    (source tensors not used), `warnings`; plus `paths` ({`artifact`, `conversion_json`,
    `sha256sums`}: full paths, not written to the file).
    """
    plan_recipe = RECIPES.get(recipe)
    if plan_recipe is None:
        raise ConvertError(f"unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    source = open_source(src)
    out = Path(out)
    if out.is_dir():
        out = out / f"{source.repo.split('/')[-1]}.{recipe}.ninfer"
    if out.exists() and not overwrite:
        raise ConvertError(f"{out} already exists (pass --force to replace it)")
    text = resolve_text_config(source)
    mtp_config_layers = int(source.text_config.get("mtp_num_hidden_layers", 1))
    comps = _components(components, has_mtp(source.store) and mtp_config_layers > 0)
    mtp_layers = mtp_config_layers if "mtp" in comps else 0
    entries = plan_tensors(source.store, text, source.tied, mtp_layers)
    requested = [plan_recipe.encoding_for(e.logical) for e in entries]
    targets = [resolve_target(e, source.store, r) for e, r in zip(entries, requested)]

    warnings = list(source.warnings)
    kept = sum(1 for t, r in zip(targets, requested) if t.path == "nvfp4" and r not in (KEEP, "nvfp4"))
    if kept:
        warnings.append(f"{kept} tensor(s) arrived as NVFP4 and stay nvfp4 (NVFP4 codes are never requantized)")
    consumed = {n for e in entries for leaf in e.leaves() for n in (leaf.data, leaf.scale, leaf.glob, *leaf.extra) if n}
    skipped = sorted(n for n in source.store.names() if n not in consumed)
    note = _skipped_warning(skipped, comps, source.tied)
    if note:
        warnings.append(note)
    if progress:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)

    revision = source.revision
    src_record: dict[str, Any] = {"path": source.path.resolve().name}
    if revision:
        src_record["revision"] = revision
    provenance = {
        "recipe": recipe,
        "converter": f"ninfer {__version__}",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "sources": [{"repo": source.repo, **({"revision": revision} if revision else {})}],
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(str(out) + ".partial")
    reserve = 65536 + 1024 * len(entries)
    bar = Progress(len(entries), enabled=progress)
    tensors: dict[str, Any] = {}
    try:
        writer = _core.ArtifactWriter(str(out), reserve)
        writer.set_meta(ARCH, name or source.repo.split("/")[-1], json.dumps(provenance))
        writer.set_component("text", json.dumps(text))
        if mtp_layers:
            writer.set_component("mtp", json.dumps({"num_layers": mtp_layers}))
        for entry, target in zip(entries, targets):
            enc = encode(entry, source.store, target)
            writer.add_tensor(entry.logical, enc.encoding, enc.shape, entry.component, enc.parts)
            tensors[entry.logical] = {
                "sources": enc.sources, "encoding": enc.encoding, "shape": enc.shape, "bytes": enc.nbytes
            }
            bar.update(entry.logical, enc.nbytes)
        for res_name, blob in source.resources.items():
            writer.add_resource(res_name, blob)
        writer.finish()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise

    by_encoding: Counter[str] = Counter()
    for t in tensors.values():
        by_encoding[t["encoding"]] += t["bytes"]
    digest = _sha256(out)
    report: dict[str, Any] = {
        "recipe": recipe,
        "source": src_record,
        "artifact": out.name,
        "sha256": digest,
        "components": comps,
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "bytes": sum(by_encoding.values()), "bytes_by_encoding": dict(by_encoding)},
        "resources": sorted(source.resources),
        "skipped": skipped,
        "warnings": warnings,
    }
    cj = conversion_json_path(out)
    cj.write_text(_report_json(report), encoding="utf-8")
    sums = _record_sha256(out, digest)
    bar.finish(f"wrote {out.name}")
    return {**report, "paths": {"artifact": str(out), "conversion_json": str(cj), "sha256sums": str(sums)}}
