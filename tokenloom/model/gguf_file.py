"""A GGUF file's metadata and tensors, read lean.

gguf's `GGUFReader` keeps a numpy view for every element of every array: Qwen2.5's 151,936 tokens and
151,387 merges cost it 8 s and 490 MB. Freed after the load, that garbage left the heap in holes that a
serving process's step buffers then kept faulting back in. Here an array of strings is one Python list
and an array of numbers one numpy view, read with the format's own constants from `gguf`; the tensors are
views of one read-only memmap laid out as `GGUFReader` lays them out, so the loaders take either.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_U64 = struct.Struct("<Q")
_SCALARS = {  # value type -> (struct format, numpy dtype) of one little-endian item
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
# Tensor types whose data is a plain array of numbers; every other type is blocks, viewed as bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Field:
    """One metadata value: a Python scalar or string, or a list (of strings, numbers or lists: an array of
    arrays stays nested, where GGUFReader's contents() flattens it)."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order: the fastest-moving dimension first
    n_bytes: int
    data_offset: int
    data: np.ndarray  # [rows..., row] of the type's numbers, or of its blocks' bytes


class GGUFFile:
    """`fields` (key -> Field), `tensors` (in file order) and `data`, the whole file mapped read-only (each
    tensor's `data` a view of it). A file that is not a complete little-endian GGUF (v2 or v3) raises
    ValueError saying what is wrong."""

    def __init__(self, path: str):
        self.path = path
        self.data = np.memmap(path, mode="r")
        self._buf, self._at = memoryview(self.data), 0
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read; a big-endian file shows as a huge one)")
        n_tensors, n_fields = self._unpack("<QQ")
        self._fits(n_fields * 12 + n_tensors * 24, "metadata")  # each at least that many bytes
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = Field(self._value(GGUFValueType(self._unpack("<I")[0])))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.fields["general.alignment"].value if "general.alignment" in self.fields else 32
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")
        del self._buf

    def _fits(self, size: int, what: str) -> None:
        if size < 0 or self._at + size > len(self._buf):
            raise ValueError(f"truncated: {what} runs past the end of the file ({len(self._buf)} bytes)")

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self._fits(size, "a header value")
        values = struct.unpack_from(fmt, self._buf, self._at)
        self._at += size
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        self._fits(n, "a string")
        text = str(self._buf[self._at : self._at + n], "utf-8")
        self._at += n
        return text

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])[0]
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
        if item in _SCALARS:  # one view for the whole array
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            self._fits(count * dtype.itemsize, "an array")
            values = np.frombuffer(self._buf, dtype, count, self._at)
            self._at += count * dtype.itemsize
            return values.tolist()
        self._fits(count * 8, "an array")  # strings and arrays: at least a length each
        if item == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, its merges: 150k-260k of them) in one loop: the per-item
        `_value` calls were a large part of a warm model load."""
        buf, at, end, out = self._buf, self._at, len(self._buf), []
        length, append = _U64.unpack_from, out.append
        for _ in range(count):
            if at + 8 > end:
                raise ValueError(f"truncated: a string runs past the end of the file ({end} bytes)")
            (n,) = length(buf, at)
            at += 8
            if at + n > end:
                raise ValueError(f"truncated: a string runs past the end of the file ({end} bytes)")
            append(str(buf[at : at + n], "utf-8"))
            at += n
        self._at = at
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        self._fits(n_dims * 8, f"tensor {name!r}'s shape")
        shape = self._unpack(f"<{n_dims}Q")
        return name, shape, GGMLQuantizationType(self._unpack("<I")[0]), self._unpack("<Q")[0]

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> Tensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if not shape:
            raise ValueError(f"tensor {name!r} has no dimensions")
        if shape[0] % block:
            raise ValueError(f"tensor {name!r}: shape {shape} is not whole {kind.name} blocks of {block}")
        n_bytes = math.prod(shape) // block * block_bytes
        at = start + offset
        if at + n_bytes > len(self.data):
            raise ValueError(f"truncated: tensor {name!r} ends at byte {at + n_bytes}, the file has {len(self.data)}")
        rows = tuple(reversed(shape[1:]))
        stored = self.data[at : at + n_bytes]  # a view of the map (release_mapped_pages reads its _mmap)
        if kind in _PLAIN:
            data = stored.view(_PLAIN[kind]).reshape(*rows, shape[0])
        else:
            data = stored.reshape(*rows, shape[0] // block * block_bytes)
        return Tensor(name, kind, tuple(int(d) for d in shape), n_bytes, at, data)
