"""Text data: byte and GPT-2 tokens, a deterministic split, and a token cache made once."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.run import train
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.tokens import CACHE_DIRNAME, build_text
from helpers.disks import fill, small_disk
from helpers.runs import FAST_TRAINER, TINY_GPT
from helpers.warm_python import python_m

ON_CPU = Placement(0, torch.device("cpu"))
# A tiny GPT on a text file given as dataset.path.
FAST_TEXT = [*FAST_TRAINER, *TINY_GPT, "dataset=text", "dataset.batch_size=8"]
SENTENCE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture
def text_cfg(compose_cfg):
    def _text_cfg(*overrides: str):
        return validate(compose_cfg(*FAST_TEXT, *overrides, fast=False))

    return _text_cfg


def test_text_file_run_reports_perplexity_and_caches_its_tokens_beside_it(
    text_cfg, tmp_path
) -> None:
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(SENTENCE * 200)
    cfg = text_cfg(f"dataset.path={corpus}")
    summary = train(cfg, tmp_path / "run")
    assert summary["dataset"] == "text" and summary["task"] == "lm"
    assert 1 < summary["eval_perplexity"] < 256 and summary["loss_floor"] is None
    cached = list((corpus.parent / CACHE_DIRNAME).glob("corpus.txt.bytes.*.npy"))
    assert len(cached) == 1
    assert cached[0].stat().st_mode & 0o044 == 0o044  # readable by whoever reads the data
    assert bytes(np.load(cached[0]).astype(np.uint8)) == corpus.read_bytes()


def test_text_folder_split_is_deterministic_and_tokenized_once(
    text_cfg, tmp_path, monkeypatch
) -> None:
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "b.txt").write_text("B" * 600)
    (folder / "a.txt").write_text("A" * 400)
    (folder / "notes.md").write_text("left out")
    cfg = text_cfg(f"dataset.path={folder}", "dataset.eval_fraction=0.2")
    data = build_text(cfg.dataset, 16, ON_CPU)
    train_tokens = torch.cat([x for x, _ in data.train])
    eval_tokens = torch.cat([x for x, _ in data.eval])
    assert set(train_tokens.unique().tolist()) == {ord("A"), ord("B")}
    assert set(eval_tokens.unique().tolist()) == {ord("B")}  # the last 20%: b.txt's tail
    assert data.facts == {"vocab_size": 256, "seq_len": 16}

    def no_second_tokenizing(*args):
        raise AssertionError("tokenized again instead of reading the cache")

    monkeypatch.setattr("amp_exp.tasks.tokens.tokenize", no_second_tokenizing)
    again = build_text(cfg.dataset, 16, ON_CPU)
    assert torch.equal(torch.cat([x for x, _ in again.eval]), eval_tokens)


def test_text_beside_an_unwritable_place_is_cached_in_the_cache_dir(text_cfg, tmp_path) -> None:
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(SENTENCE * 20)
    # Tests run as root, who may write anywhere: a file where the cache folder would go makes
    # the data's folder unusable for the cache all the same.
    (corpus.parent / CACHE_DIRNAME).write_text("in the way")
    cache = tmp_path / "cache"
    cfg = text_cfg(f"dataset.path={corpus}", f"dataset.cache_dir={cache}")
    build_text(cfg.dataset, 16, ON_CPU)
    assert len(list(cache.glob("corpus.txt.bytes.*.npy"))) == 1


def test_gpt2_tokenizer_without_its_cached_files_says_how_to_get_them(
    text_cfg, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SENTENCE * 20)
    cfg = text_cfg(f"dataset.path={corpus}", "dataset.tokenizer=gpt2")
    with pytest.raises(ConfigError) as raised:
        build_text(cfg.dataset, 16, ON_CPU)
    message = str(raised.value)
    assert "not cached" in message and "tiktoken.get_encoding('gpt2')" in message
    assert "\n" not in message


@pytest.mark.slow
def test_cli_without_the_gpt2_files_exits_2_with_one_line(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SENTENCE * 20)
    missing = python_m(
        "amp_exp",
        *FAST_TEXT,
        f"dataset.path={corpus}",
        "dataset.tokenizer=gpt2",
        f"hydra.run.dir={tmp_path / 'missing'}",
        timeout=300,
        env={**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty")},
    )
    assert missing.returncode == 2
    errors = [line for line in missing.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "tiktoken's GPT-2 files are not cached" in errors[0]


def corpus_of(tmp_path, size: int = 20) -> Path:
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(SENTENCE * size)
    return corpus


def test_a_corrupt_token_cache_is_rebuilt_and_said_once(text_cfg, tmp_path, caplog) -> None:
    corpus = corpus_of(tmp_path)
    cfg = text_cfg(f"dataset.path={corpus}")
    build_text(cfg.dataset, 16, ON_CPU)
    [cached] = (corpus.parent / CACHE_DIRNAME).glob("*.npy")
    cached.write_bytes(cached.read_bytes()[:100])  # a copy cut short
    with caplog.at_level(logging.WARNING):
        data = build_text(cfg.dataset, 16, ON_CPU)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        warning.startswith(f"token cache {cached} is unreadable (")
        and "tokenizing again" in warning
    )
    assert len(data.train) > 0
    assert bytes(np.load(cached).astype(np.uint8)) == corpus.read_bytes()  # rebuilt


def no_room_for_the_cache(monkeypatch) -> None:
    """np.save on a full disk: part of the file written, then ENOSPC."""

    def save_half(file, array) -> None:
        file.write(b"\x93NUMPY half a header")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", save_half)


def test_a_token_cache_the_disk_refuses_costs_a_warning_and_no_files(
    text_cfg, tmp_path, monkeypatch, caplog
) -> None:
    corpus = corpus_of(tmp_path, size=200)
    cache = tmp_path / "cache"
    no_room_for_the_cache(monkeypatch)
    with caplog.at_level(logging.WARNING):
        summary = train(
            text_cfg(f"dataset.path={corpus}", f"dataset.cache_dir={cache}"), tmp_path / "run"
        )
    assert summary["status"] == "completed"
    [warning] = [r.getMessage() for r in caplog.records if "could not cache" in r.getMessage()]
    assert warning.endswith(
        "(No space left on device); training on them all the same, and tokenizing again next time"
    )
    assert list((corpus.parent / CACHE_DIRNAME).iterdir()) == [] and list(cache.iterdir()) == []


def test_a_token_cache_on_a_really_full_disk_leaves_no_partial_file(text_cfg, tmp_path) -> None:
    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_bytes(os.urandom(2**20))  # 1 MB, and 2 MB of tokens
    (corpus.parent / CACHE_DIRNAME).write_text("in the way")  # the cache goes to cache_dir
    with small_disk(tmp_path / "disk", 1024) as disk:
        fill(disk, 64)
        cfg = text_cfg(f"dataset.path={corpus}", f"dataset.cache_dir={disk / 'tokens'}")
        data = build_text(cfg.dataset, 16, ON_CPU)
        assert len(data.train) > 0
        assert not list((disk / "tokens").glob("*"))  # no partial .tmp file fills the disk
