"""StopStringMatcher: hold back only what may become a stop, match across deltas, first stop wins."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.stop_strings import StopStringMatcher


def run(stops, deltas, include_stop=False):
    """Feed all deltas; return (released text, matched stop, released text per feed)."""
    m = StopStringMatcher(tuple(stops), include_stop)
    out, pieces, matched = "", [], None
    for d in deltas:
        released, matched = m.feed(d)
        pieces.append(released)
        out += released
        if matched is not None:
            return out, matched, pieces
    tail = m.flush()
    return out + tail, None, pieces


def reference(text, stops, include_stop=False):
    """The text cut at the stop occurrence that ends first (on a tie, the longer stop)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[:i] + (s if include_stop else ""), s


def longest_partial(text, stops):
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


def test_no_stops_passes_through():
    m = StopStringMatcher((), False)
    assert m.feed("hello") == ("hello", None)
    assert m.feed("") == ("", None)
    assert m.flush() == ""


def test_match_inside_one_delta():
    assert run(["STOP"], ["abc STOP def"]) == ("abc ", "STOP", ["abc "])
    assert run(["STOP"], ["abc STOP def"], include_stop=True)[0] == "abc STOP"


def test_stop_spanning_deltas_is_held_then_matched():
    m = StopStringMatcher(("<|end|>",), False)
    assert m.feed("Hello <") == ("Hello ", None)
    assert m.held == "<"
    assert m.feed("|en") == ("", None)
    assert m.feed("d|> tail") == ("", "<|end|>")
    assert m.matched == "<|end|>"


def test_false_start_is_released():
    m = StopStringMatcher(("###",), False)
    assert m.feed("a ##") == ("a ", None)
    assert m.feed("b") == ("##b", None)
    assert m.flush() == ""


def test_holds_only_the_longest_partial_prefix_not_a_window():
    m = StopStringMatcher(("abcdefgh", "xyz"), False)
    assert m.feed("hello world ab") == ("hello world ", None)
    assert m.held == "ab"
    assert m.feed("c") == ("", None)
    assert m.feed("x") == ("abc", None)  # "abcx" can no longer become "abcdefgh"; "x" may start "xyz"
    assert m.held == "x"


def test_include_stop_across_deltas():
    m = StopStringMatcher(("\n\n",), True)
    assert m.feed("line\n") == ("line", None)
    assert m.feed("\nmore") == ("\n\n", "\n\n")


def test_earliest_completed_stop_wins():
    # "bc" is complete before "abcd" is, so token-by-token generation would have stopped there
    assert run(["abcd", "bc"], ["xabcd"]) == ("xa", "bc", ["xa"])
    assert run(["abcd", "bc"], ["x", "a", "b", "c", "d"])[:2] == ("xa", "bc")
    # same end: the longer stop (the earlier start) wins
    assert run(["bc", "abc"], ["xabc"])[:2] == ("x", "abc")
    # different stops, different places: the first in the text, whatever the order in the list
    assert run(["zz", "yy"], ["a yy b zz"])[:2] == ("a ", "yy")


def test_feed_after_match_or_flush_is_an_error():
    m = StopStringMatcher(("x",), False)
    assert m.feed("axb") == ("a", "x")
    with pytest.raises(RuntimeError):
        m.feed("more")
    assert m.flush() == ""
    m = StopStringMatcher(("x",), False)
    m.flush()
    with pytest.raises(RuntimeError):
        m.feed("more")


def test_flush_releases_partial_stop():
    m = StopStringMatcher(("</s>",), False)
    assert m.feed("the end </") == ("the end ", None)
    assert m.flush() == "</"


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(("",), False)


def test_unicode_stops():
    assert run(["。"], ["你好", "世界。", "再见"]) == ("你好世界", "。", ["你好", "世界"])
    assert run(["🙂!"], ["ok 🙂", "!"], include_stop=True)[:2] == ("ok 🙂!", "🙂!")


def test_long_stop_string_is_cheap():
    stop = "ab" * 500 + "c"
    m = StopStringMatcher((stop,), False)
    released = ""
    for _ in range(1000):
        r, matched = m.feed("ab")
        released += r
        assert matched is None
    # the held text is at most len(stop) - 1 and the rest went out
    assert len(m.held) <= len(stop) - 1
    assert released + m.held == "ab" * 1000
    r, matched = m.feed("c")
    assert matched == stop and released + r == "ab" * 500


def split_points(text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab c\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
    include_stop=st.booleans(),
)
def test_property_released_text_matches_reference(text, stops, cuts, include_stop):
    deltas = split_points(text, cuts)
    expected, expected_stop = reference(text, stops, include_stop)
    m = StopStringMatcher(tuple(stops), include_stop)
    released, matched, fed = "", None, ""
    for d in deltas:
        r, matched = m.feed(d)
        fed += d
        released += r
        assert expected.startswith(released)  # never releases text that a later stop would cut
        if matched is not None:
            break
        # and holds back no more than the longest suffix that could still start a stop
        assert m.held == fed[len(fed) - longest_partial(fed, stops) :]
        assert released + m.held == fed
    if matched is None:
        released += m.flush()
    assert (released, matched) == (expected, expected_stop)
