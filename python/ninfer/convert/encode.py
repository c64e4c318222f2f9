"""Encoding one logical tensor: copy, NVFP4 pass-through, or quantize with the reference codec.

Three paths (docs/format.md §3):
- keep: the source bytes of each leaf, concatenated in row order (bit for bit).
- NVFP4 pass-through: codes and E4M3 block scales copied bit for bit; the per-matrix global
  becomes the multiplier (ModelOpt `weight_scale_2` as is, compressed-tensors
  `weight_global_scale` inverted, model-spec.md §4.2-4.3). A fused gate‖up whose two halves carry
  different globals keeps both (`global` [M, 2]); otherwise one per matrix ([M, 1]).
- quantize: f32 values through `ninfer._core.quantize`, a bounded number of elements at a time
  (rows of a matrix, whole experts of a bank, whole matrices for NVFP4 whose global is per matrix),
  several chunks in parallel threads.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ninfer import _core
from ninfer.convert.mapping import Entry, Leaf
from ninfer.convert.recipes import GROUP_SIZES, KEEP
from ninfer.convert.safetensors_io import TensorStore, to_f32
from ninfer.convert.source import ConvertError

__all__ = ["Encoded", "Target", "resolve_target", "encode"]

# Elements converted to f32 per quantize call (64 MiB of f32). At most WORKERS chunks are in
# flight (the codec releases the GIL), which bounds memory for any tensor size.
CHUNK_ELEMS = 1 << 24
WORKERS = min(8, os.cpu_count() or 1)

_KEEP_DTYPES = {"BF16": "bf16", "F32": "f32", "F16": "f16"}
_PART = tuple[str, list[int], bytes]


@dataclass(frozen=True)
class Target:
    """What an entry becomes: encoding, logical shape, and how (copy / nvfp4 / quantize)."""

    encoding: str
    shape: list[int]
    path: str  # "copy", "nvfp4" or "quantize"


@dataclass
class Encoded:
    encoding: str
    shape: list[int]
    parts: list[_PART]
    sources: list[str]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, _, b in self.parts)


def _fused_bank(entry: Entry, store: TensorStore) -> bool:
    return entry.bank and len(entry.matrices) == 1 and len(store.info(entry.matrices[0][0].data).shape) == 3


def _concat_shape(entry: Entry, shapes: list[list[tuple[int, ...]]]) -> list[int]:
    """Logical shape of row-concatenated leaves (stacked per expert for a bank)."""
    mats = []
    for m in shapes:
        tails = {s[1:] for s in m}
        if len(tails) != 1:
            raise ConvertError(f"`{entry.logical}`: sources {[list(s) for s in m]} cannot be stacked by rows")
        mats.append([sum(s[0] for s in m), *next(iter(tails))])
    if entry.bank:
        if any(m != mats[0] for m in mats):
            raise ConvertError(f"`{entry.logical}`: experts have different shapes")
        return [len(mats), *mats[0]]
    return mats[0]


def _nvfp4_source_shape(entry: Entry, store: TensorStore) -> list[int]:
    shapes = []
    for m in entry.matrices:
        row = []
        for leaf in m:
            codes, scales = store.info(leaf.data), store.info(leaf.scale or "")
            if len(codes.shape) != 2 or codes.dtype not in ("U8", "I8"):
                raise ConvertError(
                    f"`{leaf.data}`: NVFP4 codes must be a 2-D uint8 tensor, got {codes.dtype} {list(codes.shape)}"
                )
            k = codes.shape[1] * 2
            if k % 16 or scales.dtype not in ("F8_E4M3", "U8") or scales.shape != (codes.shape[0], k // 16):
                raise ConvertError(
                    f"`{leaf.base}`: NVFP4 needs {k} columns to be a multiple of 16 and E4M3 block scales "
                    f"of shape {[codes.shape[0], k // 16]}, got {scales.dtype} {list(scales.shape)}"
                )
            row.append((codes.shape[0], k))
        shapes.append(row)
    return _concat_shape(entry, shapes)


def resolve_target(entry: Entry, store: TensorStore, requested: str) -> Target:
    """Decides encoding and shape from headers alone, so every error surfaces before writing."""
    kinds = {leaf.kind for leaf in entry.leaves()}
    if len(kinds) > 1 and "plain" in kinds:
        raise ConvertError(f"`{entry.logical}` mixes NVFP4 and unquantized sources: {[l.base for l in entry.leaves()]}")
    if "plain" not in kinds:
        return Target("nvfp4", _nvfp4_source_shape(entry, store), "nvfp4")
    infos = [[store.info(leaf.data) for leaf in m] for m in entry.matrices]
    if _fused_bank(entry, store):
        shape = list(infos[0][0].shape)
    else:
        shapes = [[info.shape for info in m] for m in infos]
        if entry.bank and any(len(s) != 2 for m in shapes for s in m):
            raise ConvertError(f"`{entry.logical}`: per-expert sources must be matrices")
        shape = _concat_shape(entry, shapes)
    if entry.squeeze:
        if len(shape) != 3 or shape[1] != 1:
            raise ConvertError(f"`{entry.logical}`: expected a [C, 1, K] depthwise conv weight, got {shape}")
        shape = [shape[0], shape[2]]
    if requested == KEEP:
        dtypes = {info.dtype for m in infos for info in m}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _KEEP_DTYPES:
            raise ConvertError(f"`{entry.logical}`: cannot store source dtype(s) {sorted(dtypes)} as they are")
        return Target(_KEEP_DTYPES[dtypes.pop()], shape, "copy")
    group = GROUP_SIZES.get(requested, 1)
    if shape[-1] % group != 0:
        raise ConvertError(
            f"tensor `{entry.logical}` (shape {shape}) cannot be stored as {requested}: its last "
            f"dimension {shape[-1]} is not a multiple of the group size {group}"
        )
    return Target(requested, shape, "quantize")


def _copy(entry: Entry, store: TensorStore, target: Target) -> list[_PART]:
    data = b"".join(store.array(leaf.data).tobytes() for leaf in entry.leaves())
    return [("data", target.shape, data)]


def _global_multiplier(store: TensorStore, leaf: Leaf) -> np.float32:
    g = store.f32(leaf.glob or "").reshape(-1)
    if g.size != 1:
        raise ConvertError(f"`{leaf.glob}`: expected one per-tensor scale, got {g.size} values")
    # ModelOpt stores the multiplier, compressed-tensors its reciprocal (model-spec.md §4.3).
    return g[0] if leaf.kind == "modelopt" else np.float32(1.0) / g[0]


def _nvfp4(entry: Entry, store: TensorStore, target: Target) -> list[_PART]:
    codes, scales, globals_ = [], [], []
    for m in entry.matrices:
        for leaf in m:
            codes.append(store.array(leaf.data).tobytes())
            scales.append(store.array(leaf.scale or "").tobytes())
        globals_.append([_global_multiplier(store, leaf) for leaf in m])
    if all(len(set(g.tobytes() for g in gs)) == 1 for gs in globals_):
        segments = 1
        table = np.array([[gs[0]] for gs in globals_], dtype=np.float32)
    else:
        # Different globals for gate and up: one per equal row segment (docs/format.md §3).
        segments = len(entry.matrices[0])
        rows = {store.info(leaf.data).shape[0] for leaf in entry.leaves()}
        if len(rows) != 1:
            raise ConvertError(f"`{entry.logical}`: sources with different global scales must have equal row counts")
        table = np.array(globals_, dtype=np.float32)
    n, k = target.shape[-2], target.shape[-1]
    lead = target.shape[:-2]
    return [
        ("codes", [*lead, n, k // 2], b"".join(codes)),
        ("scales", [*lead, n, k // 16], b"".join(scales)),
        ("global", [table.shape[0], segments], table.tobytes()),
    ]


def _f32_chunks(entry: Entry, store: TensorStore, target: Target) -> Iterator[np.ndarray]:
    """The tensor's values as f32, in consecutive slices along its first dimension."""
    shape = target.shape
    inner = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else shape[0]
    whole = len(shape) == 1 or (target.encoding == "nvfp4" and not entry.bank)
    step = shape[0] if whole else max(1, CHUNK_ELEMS // max(inner, 1))
    if entry.bank and not _fused_bank(entry, store):
        for e0 in range(0, shape[0], step):
            yield np.stack([
                np.concatenate([store.f32(leaf.data) for leaf in m]) for m in entry.matrices[e0 : e0 + step]
            ])
        return
    # A fused bank or row-concatenated leaves: slice rows across the leaves.
    pieces = [(store.array(leaf.data).reshape(-1, *shape[1:]), store.info(leaf.data).dtype) for leaf in entry.leaves()]
    for r0 in range(0, shape[0], step):
        r1 = min(r0 + step, shape[0])
        out, offset = [], 0
        for arr, dtype in pieces:
            lo, hi = max(r0 - offset, 0), min(r1 - offset, arr.shape[0])
            if lo < hi:
                out.append(to_f32(arr[lo:hi], dtype))
            offset += arr.shape[0]
        yield np.concatenate(out)


def _in_order(fn: Callable[[np.ndarray], list[_PART]], items: Iterable[np.ndarray]) -> Iterator[list[_PART]]:
    """`map(fn, items)` on a thread pool with at most WORKERS items in flight, results in order."""
    with ThreadPoolExecutor(WORKERS) as pool:
        pending: deque[Future[list[_PART]]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= WORKERS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _quantize(entry: Entry, store: TensorStore, target: Target) -> list[_PART]:
    def run(chunk: np.ndarray) -> list[_PART]:
        data = np.ascontiguousarray(chunk, dtype=np.float32).tobytes()
        return _core.quantize(target.encoding, data, list(chunk.shape))

    names: list[str] = []
    shapes: dict[str, list[int]] = {}
    data: dict[str, list[bytes]] = {}
    for parts in _in_order(run, _f32_chunks(entry, store, target)):
        for name, shape, blob in parts:
            if name not in shapes:
                names.append(name)
                shapes[name], data[name] = list(shape), []
            else:
                # Chunks run along the first dimension, so every part grows along its first one.
                shapes[name][0] += shape[0]
            data[name].append(blob)
    return [(name, shapes[name], b"".join(data[name])) for name in names]


def encode(entry: Entry, store: TensorStore, target: Target) -> Encoded:
    make = {"copy": _copy, "nvfp4": _nvfp4, "quantize": _quantize}[target.path]
    return Encoded(target.encoding, target.shape, make(entry, store, target), [leaf.data for leaf in entry.leaves()])
