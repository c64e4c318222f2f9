"""`ninfer doctor`: what this machine can run, and whether a model fits.

Reports Python and the ninfer build, the NVIDIA driver and every GPU (name, compute capability,
free memory, which of our kernel builds it can load), and for a given artifact and context the
memory it needs against what is free. GPU facts come from the driver library itself (libcuda,
through ctypes), so no CUDA toolkit or nvidia-smi is needed.
"""

from __future__ import annotations

import ctypes
import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ninfer import __version__

__all__ = ["Gpu", "Report", "gather", "kernels_for", "memory_plan"]

# cuDeviceGetAttribute ids (CUDA driver API).
_CC_MAJOR, _CC_MINOR = 75, 76


@dataclass
class Gpu:
    index: int
    name: str
    compute_capability: str
    total_bytes: int
    free_bytes: int | None
    kernels: str


@dataclass
class Report:
    python: str
    ninfer: str
    platform: str
    cuda_backend_built: bool
    driver: str | None
    gpus: list[Gpu] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model: dict | None = None


def kernels_for(major: int, minor: int) -> str:
    """Which embedded kernel build a card of this compute capability loads (DESIGN.md §5)."""
    if (major, minor) == (9, 0):
        return "sm_90a cubins"
    if major == 12:
        return "sm_120a cubins"
    if major >= 9:
        return "compute_90 PTX (JIT by the driver)"
    return "none: ninfer needs compute capability 9.0 (Hopper) or newer"


def _driver() -> tuple[str | None, list[Gpu], list[str]]:
    notes: list[str] = []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, [], ["no NVIDIA driver found (libcuda.so.1); only the CPU backend can run"]
    if cuda.cuInit(0) != 0:
        return None, [], ["the NVIDIA driver is installed but cuInit failed (no usable GPU?)"]
    ver = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(ver))
    driver = f"CUDA {ver.value // 1000}.{ver.value % 1000 // 10}"
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for i in range(count.value):
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, dev)
        major, minor = ctypes.c_int(), ctypes.c_int()
        cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)
        total = ctypes.c_size_t()
        cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
        free_bytes = None
        ctx = ctypes.c_void_p()
        if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
            free, tot = ctypes.c_size_t(), ctypes.c_size_t()
            if cuda.cuCtxSetCurrent(ctx) == 0 and cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(tot)) == 0:
                free_bytes = free.value
            cuda.cuDevicePrimaryCtxRelease_v2(dev)
        gpus.append(Gpu(i, name.value.decode(), f"{major.value}.{minor.value}", total.value, free_bytes, kernels_for(major.value, minor.value)))
    return driver, gpus, notes


def memory_plan(artifact: str | Path, context: int, concurrency: int = 1) -> dict:
    """Bytes a model needs on the GPU: weights + KV for `context` tokens + GDN state per sequence."""
    from ninfer import _core

    art = _core.Artifact(str(artifact))
    header = json.loads(art.header_json())
    cfg = header["components"]["text"]
    weights = sum(p["length"] for t in header["tensors"].values() if t["component"] == "text" for p in t["parts"].values())
    full = sum(1 for k in cfg["layer_types"] if k == "full_attention")
    linear = len(cfg["layer_types"]) - full
    kv_per_token = full * 2 * cfg["num_kv_heads"] * cfg["head_dim"] * 2  # K and V, bf16
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    gdn_state = linear * (
        cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
        + conv_dim * (cfg["linear_conv_kernel"] - 1) * 2
    )
    need = weights + concurrency * (kv_per_token * context + gdn_state)
    return {
        "artifact": str(artifact),
        "context": context,
        "concurrency": concurrency,
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "gdn_state_bytes_per_sequence": gdn_state,
        "total_bytes": need,
    }


def gather(artifact: str | Path | None = None, context: int = 32768, concurrency: int = 1) -> Report:
    from ninfer import _core

    driver, gpus, notes = _driver()
    built = bool(getattr(_core, "CUDA_BUILT", False))
    report = Report(sys.version.split()[0], __version__, platform.platform(), built, driver, gpus, notes)
    if gpus and not built:
        report.notes.append("this ninfer build has no CUDA backend yet: models run on the CPU backend")
    if artifact is not None:
        plan = memory_plan(artifact, context, concurrency)
        free = max((g.free_bytes or 0 for g in gpus), default=0)
        plan["fits_gpu"] = bool(gpus) and plan["total_bytes"] <= free
        plan["largest_free_gpu_bytes"] = free
        report.model = plan
    return report


def format_report(r: Report) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = [
        f"python        {r.python}",
        f"ninfer        {r.ninfer} (CUDA backend {'built' if r.cuda_backend_built else 'not built'})",
        f"platform      {r.platform}",
        f"driver        {r.driver or 'none'}",
    ]
    for g in r.gpus:
        free = gb(g.free_bytes) if g.free_bytes is not None else "unknown"
        lines.append(f"gpu {g.index}         {g.name}, compute {g.compute_capability}, {gb(g.total_bytes)} total, {free} free; kernels: {g.kernels}")
    if r.model:
        m = r.model
        lines.append(
            f"model         {m['artifact']}: weights {gb(m['weight_bytes'])} + KV {m['kv_bytes_per_token']} B/token x {m['context']} "
            f"+ GDN state {gb(m['gdn_state_bytes_per_sequence'])}/sequence x {m['concurrency']} = {gb(m['total_bytes'])}; "
            f"{'fits' if m['fits_gpu'] else 'does not fit'} on the GPU"
        )
    lines += [f"note          {n}" for n in r.notes]
    return "\n".join(lines)


def to_json(r: Report) -> str:
    return json.dumps(asdict(r), indent=1)
