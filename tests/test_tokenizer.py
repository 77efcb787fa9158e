"""Kimi tiktoken tokenizer: the embedded tiny tokenizer, the folder loader, and streaming detokenisation."""

import base64
import collections
import json
from pathlib import Path

import pytest
import regex

from kimi_jax.tokenizer import (K3_SPECIAL_OFFSETS, KIMI_PAT_STR, IncrementalDetokenizer, load_tokenizer,
                                load_tokenizer_folder)

TEXTS = [
    "def foo(self, x):\n    return x + 1\n",
    "Hello, world!  Trailing spaces   \n\n\tand tabs",
    "你好世界，中文English混合。",
    "emoji 🙂🚀 and family 👨‍👩‍👧 and flags 🇯🇵",
    "Ελληνικά, Русский,日本語のテキスト, 한국어",
    "",
]


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")


def _load_trainer():
    from kimi_jax.tokenizer import train_bpe
    return train_bpe


def test_tiny_special_block_mirrors_k3(tiny):
    assert tiny.vocab_size == 4096 and tiny.num_bpe_ranks == 3840
    for name, offset in K3_SPECIAL_OFFSETS.items():
        assert tiny.special_token_id(name) == 3840 + offset  # K3 id - 163584 + 3840
    assert tiny.special_token_id("<|end_of_msg|>") == 3842 and tiny.special_token_id("<|open|>") == 3843
    assert (tiny.bos_token_id, tiny.pad_token_id) == (3840, 4095)
    assert tiny.eos_token_ids == (3842, 3841)
    assert tiny.special_token_id("<|reserved_token_3848|>") == 3848
    assert len(tiny.special_tokens) == 256 and all(tiny.is_special(i) for i in tiny.special_tokens.values())
    assert not tiny.is_special(3839)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny, text):
    ids = tiny.encode(text)
    assert all(0 <= i < tiny.num_bpe_ranks for i in ids)
    assert tiny.decode(ids) == text


def test_bpe_compresses_python_source(tiny):
    text = "import os\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"
    assert len(tiny.encode(text)) < len(text.encode()) / 2.5


def test_pretokenizer_splits_han_runs():
    pattern = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    assert pattern.findall("中文English混合") == ["中文", "English", "混合"]
    assert pattern.findall("北京市 Pascal don't") == ["北京市", " Pascal", " don't"]


@pytest.mark.parametrize("name", sorted(K3_SPECIAL_OFFSETS))
def test_special_token_text_in_user_content_stays_plain(tiny, name):
    text = f"before {name} after{name}"
    ids = tiny.encode(text)
    assert not any(tiny.is_special(i) for i in ids)
    assert tiny.decode(ids) == text
    assert tiny.encode(name, allow_special=True) == [tiny.special_token_id(name)]


def test_decode_skips_special_tokens_on_request(tiny):
    ids = [tiny.special_token_id("<|open|>"), *tiny.encode("hi"), tiny.special_token_id("<|sep|>")]
    assert tiny.decode(ids) == "<|open|>hi<|sep|>"
    assert tiny.decode(ids, skip_special_tokens=True) == "hi"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.decode([4096])


@pytest.mark.parametrize("text", ["你好世界", "a🙂b🚀c", "ελληνικά and 日本語"])
def test_incremental_detokenizer_holds_split_characters(tiny, text):
    ids = tiny.encode(text)
    detok = IncrementalDetokenizer(tiny, skip_special_tokens=True)
    pieces = [detok.add(i) for i in ids]
    assert any(p == "" for p in pieces), "the text must contain a character split across tokens"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text
    assert detok.flush() == ""


def test_incremental_detokenizer_special_tokens_and_truncation(tiny):
    open_id, sep_id = tiny.special_token_id("<|open|>"), tiny.special_token_id("<|sep|>")
    ids = [open_id, *tiny.encode("é"), sep_id]
    keep = IncrementalDetokenizer(tiny, skip_special_tokens=False)
    assert "".join(keep.add(i) for i in ids) == "<|open|>é<|sep|>"
    skip = IncrementalDetokenizer(tiny, skip_special_tokens=True)
    assert "".join(skip.add(i) for i in ids) == "é"
    cut = IncrementalDetokenizer(tiny, skip_special_tokens=True)
    first_byte_of_han = tiny.encode("你")[0]
    assert cut.add(first_byte_of_han) == ""
    assert cut.flush() == "\ufffd" and cut.text == "\ufffd"


def _write_handmade(folder: Path, config: dict | None, merges=(b"ab", b"abc", b" ab")) -> None:
    ranks = [bytes([b]) for b in range(256)] + list(merges)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_loader_on_handmade_tiktoken_file(tmp_path):
    config = {"added_tokens_decoder": {"259": {"content": "[BOS]"}, "261": {"content": "<|end_of_msg|>"},
                                       "514": {"content": "[PAD]"}, "163840": {"content": "<|im_end|>"}},
              "bos_token": {"content": "[BOS]"}, "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]"}
    _write_handmade(tmp_path, config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 262]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == 259 + 256
    assert tok.encode("abc ab") == [257, 258]
    assert tok.encode("abcab") == [257, 256]
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_ids) == (259, 514, (261, 262))
    assert tok.special_token_id("<|reserved_token_260|>") == 260
    assert "<|im_end|>" not in tok.special_tokens  # ids beyond the 256-id block are ignored
    assert tok.encode("[BOS]x", allow_special=True) == [259, ord("x")]


def test_loader_defaults_to_k3_layout_and_knows_k2(tmp_path):
    _write_handmade(tmp_path, None)
    k3 = load_tokenizer_folder(tmp_path)
    assert k3.special_token_id("<|open|>") == 259 + 3 and k3.eos_token_ids == (259 + 2,)
    k2 = load_tokenizer_folder(tmp_path, layout="k2")
    assert k2.special_token_id("<|im_end|>") == 259 + 2 and k2.special_token_id("<|tool_call_end|>") == 259 + 15
    assert load_tokenizer("tiny-k2").special_token_id("<|im_middle|>") == 3840 + 17


def test_loader_rejects_bad_files(tmp_path):
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg==\n")
    with pytest.raises(ValueError, match="expected 'base64 rank'"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match="ranks must be exactly"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="neither a tokenizer preset"):
        load_tokenizer(str(tmp_path / "missing"))


def test_bpe_trainer_is_deterministic_and_merges_most_frequent_pair_first():
    trainer = _load_trainer()
    counts = collections.Counter({"abab": 3, "ab": 2, "cd": 1})
    vocab = trainer.train_bpe(counts, 259)
    assert vocab[256:] == [b"ab", b"abab", b"cd"]
    assert trainer.train_bpe(counts, 259) == vocab
