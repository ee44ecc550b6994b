"""How a group splits the work of one call: contiguous shares, about 1/N of the weight each."""

from __future__ import annotations

import random

import pytest

from treadle.engine.train_passes import share


def shares(weights: list[int], world: int) -> list[tuple[int, int]]:
    return [share(weights, r, world) for r in range(world)]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shares_are_contiguous_cover_everything_and_balance(seed, world):
    rng = random.Random(seed)
    weights = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    cuts = shares(weights, world)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(weights)
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(cuts, cuts[1:], strict=False))
    total, biggest = sum(weights), max(weights)
    for lo, hi in cuts:  # off the even share by at most one item
        assert abs(sum(weights[lo:hi]) - total / world) <= biggest


def test_every_rank_gets_rows_when_they_are_alike():
    assert shares([8] * 7, 2) == [(0, 3), (3, 7)]
    assert all(hi > lo for lo, hi in shares([8] * 8, 8))


def test_one_heavy_item_leaves_a_rank_empty():
    assert shares([1000, 1], 3)[0] == (0, 0)  # the heavy item's middle lies in rank 1's share
