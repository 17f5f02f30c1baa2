"""GGUF tensors to float32: a whole tensor at load time (`dequantize`), or a few rows at a time straight
from the file (`StoredRows`).

A quantized model keeps its token embedding and its LM head's exact rows as `StoredRows`: a lookup reads
only the rows it needs, where a float32 copy of a 150k-token vocabulary costs 545 MB for a 896-wide
model (the file stores it in 145 MB or less). A lookup reads its rows with `pread` from the page cache,
shared with every other process serving the same file, into this call's own buffer. Read through the
memory map instead, each row mapped ~64 KB of pages into this process (the kernel maps a faulting
page's neighbours too): 32 streams' rescoring rows put 30 MB in the server's resident memory a step,
and unmapping them again cost 2.8 ms a step where `pread` takes 0.7.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import torch

# Bytes per block of 32 weights for the types unpacked in torch (several times faster than numpy).
_TORCH_QUANTS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 weights of GGUF data (a whole tensor or whole rows of one). Q8_0/Q4_0/Q4_1 are unpacked
    with torch; every other type goes through the `gguf` package."""
    import gguf

    if qtype not in _TORCH_QUANTS:
        array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, _TORCH_QUANTS[qtype])
    scale = raw[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        values = raw[:, 2:].contiguous().view(torch.int8).float() * scale
    else:
        packed = raw[:, 4:] if qtype == "Q4_1" else raw[:, 2:]
        nibbles = torch.cat([packed & 0xF, packed >> 4], dim=1).float()  # low nibbles first, then high
        if qtype == "Q4_1":
            values = nibbles * scale + raw[:, 2:4].contiguous().view(torch.float16).float()
        else:
            values = (nibbles - 8) * scale
    return values.reshape(shape)


class StoredRows:
    """The rows of a 2-D GGUF tensor ([rows, dim], e.g. vocabulary x hidden) as the file stores them.
    `rows[idx]` (int64 indices of any shape) is float32 [*idx.shape, dim], bit-identical to indexing the
    whole tensor dequantized. Stands where a float32 weight did: `shape` and `dtype` as a tensor's."""

    dtype = torch.float32

    def __init__(self, data: np.ndarray, qtype: str, shape: tuple[int, int], release=None,
                 file: tuple[str, int] | None = None):
        """`data`: the tensor's bytes (or values) as mapped from the file (model/gguf_file.py), one entry per row.
        `release`: unmaps the pages `chunks` brought in, once it has read them all.
        `file`: (path, offset of the tensor's first byte): lookups read their rows from the file with
        `pread` (None: from `data`)."""
        if data.shape[0] != shape[0]:
            raise ValueError(f"StoredRows: {data.shape[0]} stored rows for a [{shape[0]}, {shape[1]}] tensor")
        self.data, self.qtype, self.shape = data, qtype, torch.Size(shape)
        self._release = release
        self._row_bytes = data[:1].nbytes
        if file is not None and data.strides[0] != self._row_bytes:
            raise ValueError("StoredRows: the rows of a file-backed tensor must be contiguous")
        self._file = open(file[0], "rb", buffering=0) if file is not None else None  # noqa: SIM115 - closed in __del__
        self._offset = file[1] if file is not None else 0

    def __del__(self):
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        flat = idx.reshape(-1).numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row index out of range [0, {self.shape[0]})")
        if not flat.size:
            return torch.empty(*idx.shape, self.shape[1])
        rows = dequantize(self._read(flat), self.qtype, (flat.size, self.shape[1]))
        return rows.reshape(*idx.shape, self.shape[1])

    def _read(self, flat: np.ndarray) -> np.ndarray:
        """The stored entries of rows `flat`."""
        if self._file is None:
            return self.data[flat]
        out = np.empty((flat.size, *self.data.shape[1:]), self.data.dtype)
        fd = self._file.fileno()
        for i, row in enumerate(flat.tolist()):
            if os.preadv(fd, [out[i]], self._offset + row * self._row_bytes) != self._row_bytes:
                raise OSError(f"StoredRows: {self._file.name} ends inside row {row}")
        return out

    def chunks(self, rows: int = 8192) -> Iterator[torch.Tensor]:
        """The whole tensor in order, `rows` rows at a time (float32 of one chunk alive at once)."""
        for start in range(0, self.shape[0], rows):
            stop = min(start + rows, self.shape[0])
            yield dequantize(self.data[start:stop], self.qtype, (stop - start, self.shape[1]))
        if self._release is not None:
            self._release()

    def dense(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype, tuple(self.shape))


class StoredEmbedding(torch.nn.Module):
    """A token embedding over `StoredRows`: the looked-up rows in float32, the table left in the file."""

    def __init__(self, rows: StoredRows):
        super().__init__()
        self.weight = rows  # read for its dtype and shape as an nn.Embedding's weight is

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, stored as {self.weight.qtype}"


def release_mapped_pages(data: np.ndarray, start: int = 0, length: int | None = None) -> None:
    """Unmap from this process the file pages in [start, start + length) (all of them by default) that
    reading tensors at load brought in: they stay in the page cache and come back one at a time as
    lookups touch them, instead of all counting in this process's resident memory. (A no-op for data
    that is not a memory map.)"""
    mapped = getattr(data, "_mmap", None)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    end = len(mapped) if length is None else min(len(mapped), start + length)
    start -= start % mmap.PAGESIZE  # madvise takes whole pages; a neighbour's edge page just comes back
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
