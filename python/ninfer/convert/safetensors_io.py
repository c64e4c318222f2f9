"""A minimal safetensors reader over numpy memmap.

numpy has no bfloat16 or float8 types, so tensors are handed out in their *storage* type: BF16 as
uint16 bits, F8_E4M3 / F8_E5M2 as uint8 codes, everything else as the matching numpy type. That
keeps copies bit-exact; `to_f32` widens a storage array when a value is needed for quantizing.
Nothing is read until a tensor is asked for, and then only its byte range (the file is mapped).

File layout: u64 little-endian header length N, N bytes of JSON (name -> dtype, shape,
data_offsets relative to the end of the header; optional `__metadata__`), then the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SafetensorsError", "TensorInfo", "TensorStore", "to_f32", "STORAGE_DTYPES"]

# safetensors dtype -> numpy storage dtype.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# A header larger than this is not a safetensors file (the format itself caps it at 100 MB).
_MAX_HEADER = 100_000_000


class SafetensorsError(ValueError):
    """A checkpoint file is malformed or a tensor is missing."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path.name}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise SafetensorsError(f"{path.name}: header length {n} runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path.name}: malformed entry for `{name}`") from None
        if dtype not in STORAGE_DTYPES:
            raise SafetensorsError(f"{path.name}: tensor `{name}` has unsupported dtype {dtype}")
        want = int(np.prod(shape, dtype=np.int64)) * STORAGE_DTYPES[dtype].itemsize
        if end - begin != want or begin < 0 or base + end > size:
            raise SafetensorsError(
                f"{path.name}: tensor `{name}` ({dtype} {list(shape)}) has byte range "
                f"{begin}..{end}, which does not fit its shape or the file"
            )
        out[name] = TensorInfo(name, path, dtype, shape, base + begin, base + end)
    return out


class TensorStore:
    """All tensors of a checkpoint spread over one or more safetensors files."""

    def __init__(self, files: list[Path]):
        self._info: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in files:
            for name, info in _read_header(path).items():
                if name in self._info:
                    raise SafetensorsError(
                        f"tensor `{name}` appears in both {self._info[name].file.name} and {path.name}"
                    )
                self._info[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return list(self._info)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._info[name]
        except KeyError:
            raise SafetensorsError(f"the checkpoint has no tensor `{name}`") from None

    def array(self, name: str) -> np.ndarray:
        """The tensor in its storage dtype, as a read-only view of the mapped file."""
        info = self.info(name)
        dtype = STORAGE_DTYPES[info.dtype]
        if info.end == info.start:
            return np.zeros(info.shape, dtype=dtype)
        mm = self._maps.get(info.file)
        if mm is None:
            mm = np.memmap(info.file, dtype=np.uint8, mode="r")
            self._maps[info.file] = mm
        return mm[info.start : info.end].view(dtype).reshape(info.shape)

    def f32(self, name: str) -> np.ndarray:
        return to_f32(self.array(name), self.info(name).dtype)


def _e4m3_table() -> np.ndarray:
    # float8_e4m3fn: bias 7, subnormals (m/8)·2^-6, S.1111.111 is NaN (model-spec.md §4.1).
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = (codes & 7).astype(np.float64)
    val = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))
    val = sign * val
    val[(e == 15) & ((codes & 7) == 7)] = np.nan
    return val.astype(np.float32)


def _e5m2_table() -> np.ndarray:
    # float8_e5m2 is the top byte of an IEEE half.
    return (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)


_FP8_TABLES = {"F8_E4M3": _e4m3_table(), "F8_E5M2": _e5m2_table()}


def to_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Widens a storage array of safetensors dtype `dtype` to float32 values."""
    if dtype == "BF16":
        return (np.asarray(arr, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype in _FP8_TABLES:
        return _FP8_TABLES[dtype][np.asarray(arr, dtype=np.uint8)]
    if dtype in ("F32", "F16", "F64"):
        return np.asarray(arr).astype(np.float32)
    raise SafetensorsError(f"dtype {dtype} does not hold real values")
