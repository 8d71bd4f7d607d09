"""The pairwise covering that ``make test`` runs of a ``pairwise`` grid (tests/covering.py)."""

from itertools import combinations, product

import pytest

from tests.covering import pairwise_cover


def _pairs(rows) -> set:
    return {(i, j, row[i], row[j]) for row in rows for i, j in combinations(range(len(row)), 2)}


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3, 3), (5, 6, 4), (2, 7, 3, 3, 2), (8, 3, 3, 3)])
def test_every_pair_of_the_product_is_covered_by_fewer_rows(sizes):
    rows = list(product(*(range(n) for n in sizes)))
    chosen = pairwise_cover(rows)
    assert chosen == sorted(set(chosen))
    assert _pairs([rows[i] for i in chosen]) == _pairs(rows)
    # at least the largest two axes' product; far below the whole product past two axes
    largest = sorted(sizes)[-2:]
    assert largest[0] * largest[1] <= len(chosen) <= (len(rows) if len(sizes) == 2 else len(rows) // 2)


def test_rows_missing_from_the_product_are_covered_as_found():
    """A grid with holes (a case a backend cannot take is absent): the pairs of the rows present."""
    rows = [row for row in product(range(4), range(3), range(3)) if not (row[0] == 3 and row[1] == 0)]
    chosen = pairwise_cover(rows)
    assert _pairs([rows[i] for i in chosen]) == _pairs(rows)


def test_one_axis_keeps_each_value_once_and_the_choice_is_stable():
    assert pairwise_cover([("a",), ("b",), ("a",), ("c",)]) == [0, 1, 3]
    assert pairwise_cover([]) == []
    rows = list(product(range(3), range(4), range(2)))
    assert pairwise_cover(rows) == pairwise_cover(list(rows))
