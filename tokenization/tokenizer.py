"""The model's tokenizer: a thin wrapper around a fast (Rust) `tokenizers.Tokenizer`.

Built from a Hugging Face folder (tokenizer.json [+ tokenizer_config.json, generation_config.json,
chat_template.jinja]) or from the tokenizer a GGUF file carries in its metadata. `save()` writes the
HF-style files, so a GGUF tokenizer converted once loads fast from a cache folder afterwards.

Which tokens end generation (`eos_token_ids`): the model's declared EOS id(s) first, then every
special token whose text is a well-known end-of-turn / end-of-text marker (the rule llama.cpp uses
for its end-of-generation set). For SmolLM2-135M-Instruct that is (2, 0): `<|im_end|>`, the EOS of
the GGUF and of HF's generation_config, and `<|endoftext|>`, the document end the base model learned;
a chat model that emits either has finished.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

# Special tokens that end generation whatever the declared EOS is (llama.cpp's end-of-generation texts).
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<|eom_id|>",
        "<EOT>",
    }
)

# Decodes of more ids than this release the GIL (the per-step decodes of a stream stay on the cheaper call).
_GIL_FREE_DECODE_IDS = 1024

# GGUF token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# Pre-tokenizers of GGUF "gpt2" (byte-level BPE) vocabularies we can build directly, keyed by
# `tokenizer.ggml.pre`. Others go through transformers' GGUF converter (see backend/checkpoint.py).
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
GGUF_BPE_PRE_TOKENIZERS = {
    # SmolLM / StarCoder: every digit is its own pre-token (HF: Digits(individual) + ByteLevel).
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL]),
    "starcoder": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL]),
    "gpt-2": lambda: _BYTE_LEVEL,
    "default": lambda: _BYTE_LEVEL,
}


class Tokenizer:
    """encode / decode / per-token text, plus the special tokens and chat template the engine needs."""

    def __init__(
        self,
        tokenizer: FastTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        eos_token: str | None = None,
    ) -> None:
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.special_token_texts: frozenset[str] = frozenset(t.content for t in added.values() if t.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = _end_of_generation_ids(eos_token_ids, added)
        if not self.eos_token_ids:
            raise ValueError("the tokenizer has no EOS token")
        self.bos_token_id: int | None = bos_token_id
        self.add_bos_token: bool = add_bos_token and bos_token_id is not None
        self.chat_template: str | None = chat_template
        # The EOS text chat templates see: the tokenizer config's, else the first EOS id's.
        self.eos_token: str = eos_token or tokenizer.id_to_token(self.eos_token_ids[0]) or ""
        self.bos_token: str = (tokenizer.id_to_token(bos_token_id) or "") if bos_token_id is not None else ""
        self._token_texts: dict[int, str] = {}

    @property
    def backend(self) -> FastTokenizer:
        """The underlying `tokenizers.Tokenizer` (for libraries that build on it, such as xgrammar)."""
        return self._tok

    # ----------------------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) become their ids.
        BOS is prepended only when the model's tokenizer config asks for it and add_special_tokens."""
        # The batch call releases the GIL while it tokenizes (`encode` holds it throughout), so a long
        # text tokenized on a worker thread leaves the other threads running; it is no slower on short ones.
        ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if self.add_bos_token and add_special_tokens:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def encode_with_text_spans(
        self, text: str, text_spans: Sequence[tuple[int, int]], add_special_tokens: bool = True
    ) -> list[int]:
        """`encode(text)`, except that in each of `text_spans` ((start, end) character offsets, in order, not
        overlapping) a special token's text is tokenized as the plain text it is: what a user typed stays
        text, while the rest of a chat prompt keeps its control tokens."""
        pieces: list[str] = []  # the text between spans, then each span's, alternately
        start = 0
        for span_start, span_end in text_spans:
            pieces += [text[start:span_start], text[span_start:span_end]]
            start = span_end
        pieces.append(text[start:])
        # One call per tokenizer: each releases the GIL while it works.
        around = self._tok.encode_batch_fast(pieces[0::2], add_special_tokens=False)
        within = self._as_text.encode_batch_fast(pieces[1::2], add_special_tokens=False) if text_spans else []
        ids: list[int] = [self.bos_token_id] if self.add_bos_token and add_special_tokens else []  # type: ignore[list-item]
        for i, encoding in enumerate(around):
            ids += encoding.ids
            if i < len(within):
                ids += within[i].ids
        return ids

    @functools.cached_property
    def _as_text(self) -> FastTokenizer:
        """A copy of the tokenizer that reads special tokens' texts as plain text (the original's
        setting stays: it is shared by every thread)."""
        copy = FastTokenizer.from_str(self._tok.to_str())
        copy.encode_special_tokens = True
        return copy

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > _GIL_FREE_DECODE_IDS:  # the batch call releases the GIL, at a small cost per call
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text of C characters has at least
        C / max_token_chars tokens (a bound that needs no tokenizing)."""
        return max(1, max(len(self._tok.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size)))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens shown ("\ufffd" for a partial UTF-8 byte)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ----------------------------------------------------------------------------- building

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json / generation_config.json / config.json /
        chat_template.jinja when present (the layout transformers writes)."""
        folder = Path(folder)
        fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_text(value: Any) -> str | None:
            if isinstance(value, dict):  # AddedToken serialized as {"content": ...}
                value = value.get("content")
            return value if isinstance(value, str) else None

        def token_id(value: Any) -> int | None:
            text = token_text(value)
            return fast.token_to_id(text) if text is not None else None

        eos_text = token_text(tok_config.get("eos_token"))
        eos_ids = [i for i in [token_id(eos_text)] if i is not None]
        eos_ids += _as_ids(gen_config.get("eos_token_id")) + _as_ids(model_config.get("eos_token_id"))
        bos_id = token_id(tok_config.get("bos_token"))
        if bos_id is None:
            bos_ids = _as_ids(gen_config.get("bos_token_id")) or _as_ids(model_config.get("bos_token_id"))
            bos_id = bos_ids[0] if bos_ids else None
        if "add_bos_token" in tok_config:
            add_bos = bool(tok_config["add_bos_token"])
        else:  # the tokenizer.json post-processor is the model's own answer
            add_bos = bos_id is not None and bos_id in fast.encode("", add_special_tokens=True).ids
        return cls(
            fast,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=_chat_template(folder, tok_config),
            add_bos_token=add_bos,
            eos_token=eos_text,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], fast: FastTokenizer | None = None) -> Tokenizer:
        """From a GGUF's `tokenizer.*` metadata (plain Python values). `fast` is a tokenizer already
        converted elsewhere (transformers) for vocabularies `build_gguf_bpe` cannot build."""
        if fast is None:
            fast = build_gguf_bpe(meta)
        eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(
            fast,
            eos_token_ids=eos_ids,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json + generation_config.json (HF layout);
        `from_hf_folder(folder)` gives back an equal tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token or None,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        generation = {"bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids)}
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


def can_build_gguf_bpe(meta: dict[str, Any]) -> bool:
    pre = meta.get("tokenizer.ggml.pre", "default")
    return meta.get("tokenizer.ggml.model") == "gpt2" and pre in GGUF_BPE_PRE_TOKENIZERS


def build_gguf_bpe(meta: dict[str, Any]) -> FastTokenizer:
    """A byte-level BPE tokenizer from a GGUF's vocabulary, merges and token types (about 1 s)."""
    if not can_build_gguf_bpe(meta):
        raise ValueError(
            f"cannot build a {meta.get('tokenizer.ggml.model')!r} / {meta.get('tokenizer.ggml.pre')!r} "
            "GGUF tokenizer directly"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    fast.pre_tokenizer = GGUF_BPE_PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]()
    fast.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(kind == _GGUF_CONTROL), normalized=False)
        for i, kind in enumerate(types)
        if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    fast.add_tokens(added)  # keeps their vocabulary ids; special=True ones are skipped by decode
    return fast


def _end_of_generation_ids(declared: Sequence[int], added: dict[int, AddedToken]) -> tuple[int, ...]:
    ids: list[int] = []
    for i in declared:
        if i is not None and i not in ids:
            ids.append(int(i))
    for i, token in sorted(added.items()):
        if token.special and token.content in END_OF_GENERATION_TEXTS and i not in ids:
            ids.append(i)
    return tuple(ids)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tok_config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
