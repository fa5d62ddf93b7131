"""benchmarks/serve_ab.py's pieces that need no server: its settings, its round order, its comparison."""

import pytest

from benchmarks.serve_ab import compare, parse_settings, round_order


def test_settings_are_key_value_pairs():
    assert parse_settings(["GOMP_SPINCOUNT=50000", "X=a=b", "EMPTY="]) == {
        "GOMP_SPINCOUNT": "50000",
        "X": "a=b",
        "EMPTY": "",
    }
    assert parse_settings(None) == {}
    for bad in ("novalue", "=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_settings([bad])


def test_the_order_alternates_so_drift_lands_on_both_sets():
    orders = [round_order(r) for r in range(4)]
    assert orders == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A")]
    assert sum(o[0] == "A" for o in orders) == sum(o[0] == "B" for o in orders)


def test_compare_takes_the_ratio_of_the_means_and_counts_rounds():
    result = compare([100.0, 110.0, 90.0, 100.0], [105.0, 100.0, 99.0, 104.0])
    assert result.a_mean == 100.0 and result.b_mean == 102.0
    assert result.b_over_a == 1.02
    assert result.b_faster_rounds == 3


def test_compare_needs_matching_rounds():
    with pytest.raises(ValueError):
        compare([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        compare([], [])
