"""The byte corpus: deterministic file list, split by file, windows."""

from __future__ import annotations

import numpy as np
import pytest

from preempt.lm.corpus import SEPARATOR, Corpus, CorpusConfig, sample_windows, split_of, tile_windows
from tests.lm import write_corpus


@pytest.fixture
def root(tmp_path):
    return write_corpus(tmp_path / "src")


def test_splits_are_by_file_and_deterministic(root):
    config = CorpusConfig(root=str(root), val_percent=20, test_percent=20)
    corpus = Corpus(config)
    names = [set(corpus.split_files[s]) for s in ("train", "val", "test")]
    assert all(names) and not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert set().union(*names) == {name for name, _ in corpus.files}
    assert not any(name.startswith("tests/") for name, _ in corpus.files)  # test dirs skipped
    for split in ("train", "val", "test"):
        for name in corpus.split_files[split]:
            assert split_of(name, 20, 20) == split
    again = Corpus(config)
    assert again.info() == corpus.info()
    stream = corpus.stream("val")
    expected = sum(len((root / n).read_bytes()) + 1 for n in corpus.split_files["val"])
    assert stream.size == expected and stream[-1] == SEPARATOR


def test_byte_cap_keeps_a_sorted_prefix(root):
    full = Corpus(CorpusConfig(root=str(root), val_percent=20, test_percent=20))
    sizes = [size for _, size in full.files]
    cap = sum(size + 1 for size in sizes[:30]) + 5
    capped = Corpus(CorpusConfig(root=str(root), max_bytes=cap, val_percent=20, test_percent=20))
    assert capped.files == full.files[:30]


def test_bad_corpus_configs_raise(tmp_path, root):
    with pytest.raises(ValueError, match="not a directory"):
        Corpus(CorpusConfig(root=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="sum to < 100"):
        CorpusConfig(val_percent=50, test_percent=50)
    with pytest.raises(ValueError, match="got no file"):
        Corpus(CorpusConfig(root=str(root), val_percent=0, test_percent=20))
    with pytest.raises(ValueError, match="unknown corpus split"):
        Corpus(CorpusConfig(root=str(root), val_percent=20, test_percent=20)).stream("dev")


def test_windows():
    stream = np.arange(100, dtype=np.uint8)
    tiles = tile_windows(stream, 10, max_bytes=35)
    assert tiles.shape == (3, 10) and tiles.dtype == np.int64
    starts = tiles[:, 0]
    assert np.all(np.diff(starts) >= 10) and tiles[-1, 0] > 50  # spread, not overlapping
    np.testing.assert_array_equal(sample_windows(stream, 4, 8, seed=1), sample_windows(stream, 4, 8, seed=1))
    assert not np.array_equal(sample_windows(stream, 4, 8, seed=1), sample_windows(stream, 4, 8, seed=2))
    with pytest.raises(ValueError):
        tile_windows(stream, 200)
