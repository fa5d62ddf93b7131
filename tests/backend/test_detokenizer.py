"""IncrementalDetokenizer: whole characters only, spaces right, deltas join to decode(all ids).

The tokenizers are built offline in the test: a byte-level vocabulary of the 256 bytes (token id ==
byte value, so every multi-byte character is split), a small byte-level BPE trained on a corpus with
emoji and CJK, and a Metaspace (SentencePiece-style) one that drops the leading space of a decode.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from backend.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, hello there! Emoji: 😀 🎉 👩‍👩‍👧 🇫🇷 and more 😀😀.",
    "你好，世界。中文测试。日本語のテキストです。한국어 텍스트.",
    "  leading spaces,\ttabs and\nnew lines   ",
    "The quick brown fox jumps over the lazy dog. Numbers 12345 and café naïve.",
]


class Adapter:
    """What the detokenizer needs from tokenization.tokenizer.Tokenizer: decode + special_token_ids."""

    def __init__(self, tok: Tokenizer, special_token_ids: frozenset[int] | None = None) -> None:
        self.tok = tok
        ids = {tok.token_to_id(s) for s in SPECIALS} - {None}
        self.special_token_ids = frozenset(ids) if special_token_ids is None else special_token_ids
        self.decode_calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decode_calls += 1
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tok.encode(text).ids

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.cache
def byte_tokenizer() -> Adapter:
    """Token id b is the byte b (no merges); ids 256.. are special tokens."""
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return Adapter(tok)


@functools.cache
def bpe_tokenizer() -> Adapter:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return Adapter(tok)


@functools.cache
def metaspace_tokenizer() -> Adapter:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "hello world again and again"] * 5, trainer)
    return Adapter(tok)


def stream(tokenizer, ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_emoji_split_over_byte_tokens():
    tok = byte_tokenizer()
    deltas, tail = stream(tok, list("a😀b".encode()))
    assert deltas == ["a", "", "", "", "😀", "b"]
    assert tail == ""


def test_cjk_split_over_byte_tokens():
    tok = byte_tokenizer()
    ids = list("你好。".encode())
    deltas, tail = stream(tok, ids)
    assert deltas == ["", "", "你", "", "", "好", "", "", "。"]
    assert tail == ""


def test_zwj_sequence_arrives_as_whole_code_points():
    tok = byte_tokenizer()
    text = "👩‍👩‍👧!"
    deltas, tail = stream(tok, list(text.encode()))
    assert "".join(deltas) + tail == text
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["👩", "\u200d", "👩", "\u200d", "👧", "!"]


def test_trained_bpe_text_round_trips_without_partial_characters():
    tok = bpe_tokenizer()
    for text in [*CORPUS, " 😀 你好 ", "\n\n  x", "🇫🇷🇫🇷"]:
        ids = tok.encode(text)
        deltas, tail = stream(tok, ids)
        assert "".join(deltas) + tail == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)


def test_leading_spaces_are_kept_byte_level():
    tok = bpe_tokenizer()
    ids = tok.encode("  leading spaces")
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "  leading spaces"
    assert deltas[0].startswith(" ")


def test_metaspace_spaces_between_tokens():
    """A SentencePiece-style decoder drops the leading space of each decode call; the prefix
    window keeps the spaces of later tokens."""
    tok = metaspace_tokenizer()
    ids = tok.encode("the cat sat on the mat hello world")
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "the cat sat on the mat hello world"
    # every word after the first starts with its space
    words = [d for d in deltas if d.strip()]
    assert all(w.startswith(" ") for w in words[1:])


def test_special_tokens_skipped_and_offsets_unbroken():
    tok = bpe_tokenizer()
    end = tok.tok.token_to_id("<|im_end|>")
    emoji = tok.encode("😀")
    ids = [*tok.encode("Hi"), end, *emoji[:1], end, *emoji[1:], end, *tok.encode(" there")]
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "Hi😀 there"
    assert deltas[len(tok.encode("Hi"))] == ""


def test_special_tokens_shown_when_not_skipped():
    tok = bpe_tokenizer()
    end = tok.tok.token_to_id("<|im_end|>")
    ids = [*tok.encode("Hi"), end, *tok.encode(" there")]
    deltas, tail = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "Hi<|im_end|> there"
    assert "<|im_end|>" in deltas


def test_repeated_special_tokens_do_not_grow_the_window():
    tok = byte_tokenizer()
    eos = tok.tok.token_to_id("<|endoftext|>")
    detok = IncrementalDetokenizer(tok)
    detok.add_token(ord("a"))
    before = tok.decode_calls
    for _ in range(1000):
        assert detok.add_token(eos) == ""
    assert tok.decode_calls - before <= 1  # decided once per special id, then never decoded again


def test_special_id_that_decode_keeps_is_not_dropped():
    """special_token_ids lists an id that decode does not skip: its text still comes out."""
    base = byte_tokenizer()
    tok = Adapter(base.tok, special_token_ids=frozenset({ord("x")}))
    deltas, tail = stream(tok, list(b"axb"))
    assert "".join(deltas) + tail == "axb"


def test_flush_releases_incomplete_character():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add_token(ord("a")) == "a"
    assert detok.add_token(0xF0) == ""
    assert detok.add_token(0x9F) == ""
    assert detok.flush() == tok.decode([0xF0, 0x9F]) == "\ufffd"
    assert detok.text == "a\ufffd"
    assert detok.flush() == ""


def test_invalid_bytes_then_text():
    tok = byte_tokenizer()
    ids = [0xF0, 0x9F, ord("a"), 0x80, ord("b")]
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_deltas_join_to_decode_byte_level(skip, data):
    """Any id sequence, even invalid UTF-8 and special tokens in the middle of a character."""
    tok = byte_tokenizer()
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tok.vocab_size - 1), max_size=40))
    deltas, tail = stream(tok, ids, skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_deltas_join_to_decode_trained_bpe(skip, data):
    tok = bpe_tokenizer()
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tok.vocab_size - 1), max_size=40))
    deltas, tail = stream(tok, ids, skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_property_valid_text_never_emits_partial_characters(text):
    tok = bpe_tokenizer()
    ids = tok.encode(text)
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas) and tail == ""


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    checkpoint = pytest.importorskip("backend.checkpoint")
    return checkpoint.load_checkpoint("smollm2").tokenizer


@pytest.mark.model
def test_smollm2_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "<|im_start|>assistant\nHello 😀! 你好，世界。 naïve café 🇫🇷<|im_end|>"
    ids = tok.encode(text)
    for skip in (True, False):
        deltas, tail = stream(tok, ids, skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)
    assert "".join(stream(tok, ids, False)[0]) == text


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_deltas_join_to_decode_metaspace(data):
    tok = metaspace_tokenizer()
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tok.vocab_size - 1), max_size=30))
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
