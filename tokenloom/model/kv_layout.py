"""Which layers' K/V share a cache block: the KV groups.

A model whose layers all attend to the whole context has one group: a block holds `block_size`
tokens' K/V for every layer, and each sequence has one block table. A model with sliding-window layers
(Gemma 3: five of every six) keeps them apart, because a sliding layer needs only the blocks its
window reaches back to while a full layer needs them all: the layers are split into groups of equal
size, each group all-full or all-sliding (one window), and each group has a block table of its own per
sequence. A sliding group's table releases blocks that fall behind its window (engine/kv_cache.py).

Every group's block has the same size (`layers_per_page` layers), so one pool of blocks serves all
groups and memory moves freely between them as sequences grow. The cache tensor is
[layers_per_page, K/V, block * block_size + offset, kv head, head dim]: the layer in slot s of any
group reads and writes plane s, at the blocks of its group's table. The group size is the largest
that divides every kind's layer count (Gemma 3 270M: 3 full and 15 sliding layers, so 6 groups of 3).
With one group the layout is the one of a plain cache: plane i is layer i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig


def window_start(position: int, window: int | None) -> int:
    """The first position a query at `position` reads in a layer of that window (0: full attention)."""
    return 0 if window is None else max(position - window + 1, 0)


@dataclass(frozen=True)
class KVLayout:
    layers_per_page: int
    group_layers: tuple[tuple[int, ...], ...]  # per group, its layers in slot order
    group_windows: tuple[int | None, ...]  # per group: None (full attention) or the sliding window

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVLayout:
        by_window: dict[int | None, list[int]] = {}
        for layer in range(cfg.num_layers):
            by_window.setdefault(cfg.window(layer), []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        groups, windows = [], []
        # Full-attention groups first: group 0's table then covers every block a sequence has computed
        # (what the prefix cache's hit counts and the dashboard's block map show).
        for window, layers in sorted(by_window.items(), key=lambda item: (item[0] is not None, item[0] or 0)):
            for i in range(0, len(layers), size):
                groups.append(tuple(layers[i : i + size]))
                windows.append(window)
        return cls(size, tuple(groups), tuple(windows))

    @property
    def num_groups(self) -> int:
        return len(self.group_layers)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot within the group) of `layer`: its block table and its cache plane."""
        for group, layers in enumerate(self.group_layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")
