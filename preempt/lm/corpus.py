"""The byte corpus of the reference LM: the running Python's standard-library sources.

Owns: the deterministic file list (sorted, tests and site-packages skipped, capped in
bytes), the split of files into train / val / test by a hash of their relative path
(never by row, so no file leaks across splits), the byte streams of each split and the
fingerprint recorded with every model trained on it (Python version, file and byte
counts, a digest). It never downloads anything: every machine that runs this project has
these files, but their content depends on the Python version, and so do all numbers
measured on them.

A split's stream is its files' bytes in file-list order, each followed by one NUL byte
(`SEPARATOR`, absent from source text) so a window that crosses a file boundary sees
where one file ends.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("train", "val", "test")
SEPARATOR = 0
# Directories whose files are not ordinary library code: test suites (mostly generated
# or pathological inputs), third-party packages, the IDLE test tree.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusConfig:
    """Which files, how many bytes and how they split. Part of the LM's cache key."""

    root: str | None = None
    """Directory of *.py sources; None: this Python's stdlib (`sysconfig` "stdlib")."""
    max_bytes: int = 16_000_000
    """Cap on the total size: files are taken in sorted order until the next would pass
    it (3.11's stdlib without tests is ~12.6 MB, so the cap binds only on larger ones)."""
    val_percent: int = 5
    """Percent of files (by path hash) in the validation split."""
    test_percent: int = 5
    """Percent of files (by path hash) in the test split."""

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"corpus max_bytes must be > 0, got {self.max_bytes}")
        if self.val_percent < 0 or self.test_percent < 0 or self.val_percent + self.test_percent >= 100:
            raise ValueError(
                f"corpus val_percent ({self.val_percent}) and test_percent ({self.test_percent}) must be "
                ">= 0 and sum to < 100"
            )

    @property
    def resolved_root(self) -> Path:
        return Path(self.root) if self.root is not None else Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str, val_percent: int, test_percent: int) -> str:
    """A file's split, a pure function of its path relative to the root (stable across
    machines and across changes to the file list)."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "big") % 100
    if bucket < test_percent:
        return "test"
    if bucket < test_percent + val_percent:
        return "val"
    return "train"


def list_files(root: Path, max_bytes: int) -> list[tuple[str, int]]:
    """(relative path, size) of the sources under `root`, sorted by path, up to `max_bytes`."""
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a directory")
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIP_DIRS.intersection(relative.parts[:-1]) or not path.is_file():
            continue
        files.append((relative.as_posix(), path.stat().st_size))
    taken, total = [], 0
    for relative, size in files:
        if total + size + 1 > max_bytes:
            break
        taken.append((relative, size))
        total += size + 1
    if not taken:
        raise ValueError(f"corpus root {root} holds no *.py file under the {max_bytes}-byte cap")
    return taken


class Corpus:
    """The split byte streams of one `CorpusConfig` (files are read on first use)."""

    def __init__(self, config: CorpusConfig | None = None) -> None:
        self.config = config or CorpusConfig()
        self.root = self.config.resolved_root
        self.files = list_files(self.root, self.config.max_bytes)
        self.split_files: dict[str, list[str]] = {name: [] for name in SPLITS}
        for relative, _ in self.files:
            self.split_files[split_of(relative, self.config.val_percent, self.config.test_percent)].append(
                relative
            )
        empty = [name for name in SPLITS if not self.split_files[name]]
        if empty:
            raise ValueError(
                f"corpus under {self.root}: split(s) {empty} got no file ({len(self.files)} files); "
                "use a larger corpus or other split percentages"
            )

    def _read(self, names: Sequence[str]) -> np.ndarray:
        parts = []
        for relative in names:
            parts.append(np.frombuffer((self.root / relative).read_bytes(), dtype=np.uint8))
            parts.append(np.array([SEPARATOR], dtype=np.uint8))
        return np.concatenate(parts)

    @cached_property
    def streams(self) -> dict[str, np.ndarray]:
        """Split name -> (N,) uint8 bytes."""
        return {name: self._read(self.split_files[name]) for name in SPLITS}

    def stream(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"unknown corpus split '{split}'; valid: {', '.join(SPLITS)}")
        return self.streams[split]

    def info(self) -> dict[str, Any]:
        """The fingerprint stored in every checkpoint trained on this corpus."""
        digest = hashlib.sha256()
        for name in SPLITS:
            digest.update(self.stream(name).tobytes())
        return {
            "source": "python-stdlib" if self.config.root is None else str(self.root),
            "python_version": sys.version.split()[0],
            "root": str(self.root),
            "num_files": {name: len(self.split_files[name]) for name in SPLITS},
            "num_bytes": {name: int(self.stream(name).size) for name in SPLITS},
            "sha256": digest.hexdigest(),
            "max_bytes": self.config.max_bytes,
            "val_percent": self.config.val_percent,
            "test_percent": self.config.test_percent,
        }


def sample_windows(stream: np.ndarray, num_windows: int, length: int, seed: int) -> np.ndarray:
    """(num_windows, length) int64 windows at seeded random offsets of `stream`."""
    if stream.size < length:
        raise ValueError(f"a stream of {stream.size} bytes cannot hold a {length}-byte window")
    starts = np.random.default_rng(seed).integers(0, stream.size - length + 1, size=num_windows)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def tile_windows(stream: np.ndarray, length: int, max_bytes: int | None = None) -> np.ndarray:
    """(N, length) int64 non-overlapping windows spread evenly over the whole stream (at
    most `max_bytes` bytes in all): the fixed held-out text of an evaluation. Spread, not
    the first bytes, so a small budget still samples every file region of the split."""
    num_windows = stream.size // length
    if max_bytes is not None:
        num_windows = min(num_windows, max_bytes // length)
    if num_windows == 0:
        raise ValueError(f"a {stream.size}-byte stream (cap {max_bytes}) holds no {length}-byte window")
    stride = stream.size // num_windows  # >= length, so the windows never overlap
    starts = np.arange(num_windows) * stride
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)
