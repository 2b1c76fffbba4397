import re

import numpy as np
import pytest
import torch

from angel_ptm.data import (
    BatchSampler,
    TextCorpus,
    TokenFile,
    build_datasets,
    load_tokens,
    split_train_val,
    write_token_file,
)
from angel_ptm.errors import ConfigValueError, DataError


@pytest.fixture(scope="module")
def stdlib_corpus() -> TextCorpus:
    return TextCorpus(max_bytes=1 << 20)


def test_default_corpus_reads_the_stdlib_and_is_non_empty(stdlib_corpus):
    assert len(stdlib_corpus) == 1 << 20  # the stdlib has more than 1 MiB of text, so the cap applies
    assert stdlib_corpus.vocab_size == 256
    assert stdlib_corpus.tokens.dtype == np.uint8
    assert not any("site-packages" in f.parts for f in stdlib_corpus.files)


def test_default_corpus_is_deterministic(stdlib_corpus):
    again = TextCorpus(max_bytes=1 << 20)
    assert np.array_equal(again.tokens, stdlib_corpus.tokens)


def test_text_files_are_joined_in_sorted_order_with_newlines(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"bb")
    (tmp_path / "a.py").write_bytes(b"a")
    (tmp_path / "sub" / "c.md").write_bytes(b"\xff")
    (tmp_path / "skip.bin").write_bytes(b"zz")
    corpus = TextCorpus(tmp_path)
    assert corpus.tokens.tobytes() == b"a\nbb\n\xff"
    assert corpus.tokens.max() == 255


def test_a_fifo_named_like_a_text_file_is_skipped_not_read_forever(tmp_path):
    """os.walk lists a FIFO named *.txt beside the text files: reading it blocked the run for good."""
    import os

    (tmp_path / "a.txt").write_bytes(b"abc")
    os.mkfifo(tmp_path / "b.txt")
    assert TextCorpus(tmp_path).tokens.tobytes() == b"abc"


def test_max_bytes_truncates_the_corpus(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"0123456789")
    assert TextCorpus(tmp_path, max_bytes=4).tokens.tobytes() == b"0123"


def test_missing_text_directory_raises_data_error_naming_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="nope"):
        TextCorpus(missing)


def test_directory_without_text_files_raises_data_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=re.escape(str(tmp_path))):
        TextCorpus(tmp_path)


@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 100_000)])
def test_token_file_round_trips(tmp_path, dtype, top):
    tokens = np.array([0, 1, 2, top, 7], dtype=np.int64)
    path = write_token_file(tmp_path / "t.bin", tokens, dtype)
    loaded = TokenFile(path, dtype)
    assert loaded.tokens.tolist() == [0, 1, 2, top, 7]
    assert len(loaded) == 5
    assert loaded.vocab_size == top + 1
    assert path.stat().st_size == 5 * np.dtype(dtype).itemsize
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]  # no temp file left behind


def test_token_file_with_partial_token_raises_data_error(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="3 bytes"):
        TokenFile(path, "uint16")


def test_missing_token_file_raises_data_error_naming_it(tmp_path):
    with pytest.raises(DataError, match="absent.bin"):
        TokenFile(tmp_path / "absent.bin")


def test_tokens_too_large_for_dtype_are_rejected(tmp_path):
    with pytest.raises(DataError, match="uint16"):
        write_token_file(tmp_path / "t.bin", [70_000], "uint16")


def test_unknown_token_dtype_is_a_config_error(tmp_path):
    with pytest.raises(ConfigValueError, match="int8"):
        TokenFile(tmp_path / "t.bin", "int8")


def test_split_puts_the_last_fraction_in_validation_without_overlap():
    tokens = np.arange(1000)
    train, val = split_train_val(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert train[-1] == 899 and val[0] == 900
    assert np.array_equal(np.concatenate([train, val]), tokens)


def test_y_is_x_shifted_by_one():
    tokens = np.arange(500, dtype=np.uint16)  # consecutive ids, so y - x == 1 everywhere
    x, y = next(BatchSampler(tokens, batch_size=4, seq_len=8, seed=0))
    assert x.dtype == torch.int64 and x.shape == (4, 8) and y.shape == (4, 8)
    assert torch.equal(y - x, torch.ones(4, 8, dtype=torch.int64))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batch_k_is_the_same_for_two_fresh_samplers():
    tokens = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint8)
    a, b = BatchSampler(tokens, 4, 32, seed=3), BatchSampler(tokens, 4, 32, seed=3)
    batches_a = [next(a) for _ in range(5)]
    for x, y in batches_a:
        bx, by = next(b)
        assert torch.equal(x, bx) and torch.equal(y, by)
    assert not torch.equal(batches_a[0][0], batches_a[1][0])
    assert not torch.equal(BatchSampler(tokens, 4, 32, seed=4).batch(0)[0], batches_a[0][0])


def test_resuming_from_state_dict_reproduces_the_uninterrupted_run():
    tokens = np.random.default_rng(1).integers(0, 256, 10_000).astype(np.uint8)
    uninterrupted = BatchSampler(tokens, 2, 16, seed=5)
    expected = [next(uninterrupted) for _ in range(6)]

    first = BatchSampler(tokens, 2, 16, seed=5)
    for _ in range(3):
        next(first)
    assert first.state_dict() == {"step": 3, "seed": 5}
    resumed = BatchSampler(tokens, 2, 16, seed=0)
    resumed.load_state_dict(first.state_dict())
    for x, y in expected[3:]:
        rx, ry = next(resumed)
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert torch.equal(BatchSampler(tokens, 2, 16, seed=5, start_step=4).batch(4)[0], expected[4][0])


def test_every_window_lies_inside_the_stream():
    tokens = np.arange(9, dtype=np.uint16)  # exactly seq_len + 1: only one possible window
    x, y = BatchSampler(tokens, batch_size=3, seq_len=8).batch(0)
    assert x.tolist() == [list(range(8))] * 3 and y.tolist() == [list(range(1, 9))] * 3


def test_stream_shorter_than_one_window_raises_data_error_with_numbers():
    with pytest.raises(DataError, match="has 8 tokens.*9"):
        BatchSampler(np.arange(8), batch_size=1, seq_len=8)


def test_load_tokens_from_a_token_file(tmp_path):
    write_token_file(tmp_path / "t.bin", [5, 6, 7], "uint32")
    tokens, vocab = load_tokens({"kind": "tokens", "path": tmp_path / "t.bin", "token_dtype": "uint32"})
    assert tokens.tolist() == [5, 6, 7] and vocab == 8


def test_load_tokens_rejects_unknown_kind():
    with pytest.raises(ConfigValueError, match="parquet"):
        load_tokens({"kind": "parquet"})


def test_build_datasets_splits_a_text_corpus(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(100)))
    train, val = build_datasets({"kind": "text", "path": tmp_path, "val_fraction": 0.2}, seq_len=8)
    assert train.tolist() == list(range(80)) and val.tolist() == list(range(80, 100))
    with pytest.raises(DataError, match="validation split has 20 tokens"):
        build_datasets({"kind": "text", "path": tmp_path, "val_fraction": 0.2}, seq_len=32)
