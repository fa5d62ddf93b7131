"""vLLM's `bad_words`: words a sequence must not generate, as token sequences and the tokens they ban.

A word is banned as the token sequences that spell it: as written (with leading spaces stripped) and,
where the tokenizer spells it differently after a space, with one space before it, so a word is banned
at the start of the text and in the middle of it. A sequence's next token is banned when it would
complete one of them: the word's last token, when the output ends with the tokens before it (a
one-token word is banned always). The same rules as vLLM's `SamplingParams.update_from_tokenizer` and
its sampler's `apply_bad_words`, so the two servers refuse the same outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

BadWordsTokenIds = tuple[tuple[int, ...], ...]


def bad_words_token_ids(words: Iterable[str], encode: Callable[[str], list[int]]) -> BadWordsTokenIds:
    """The token sequences of `words` (`encode`: the tokenizer, without special tokens)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            continue
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        # Only where a space makes a different word of the same length (vLLM's rule).
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def banned_next_tokens(bad: BadWordsTokenIds, output_token_ids: tuple[int, ...]) -> list[int]:
    """The tokens that would complete a bad word after `output_token_ids`."""
    banned = []
    for ids in bad:
        prefix = len(ids) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or output_token_ids[-prefix:] == ids[:-1]:
            banned.append(ids[-1])
    return banned
