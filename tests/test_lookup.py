"""Prompt lookup drafts what followed the latest earlier occurrence of the last few tokens."""

from medusa_heads.lookup import MIN_NGRAM, continuation, first_difference


def test_the_latest_occurrence_of_the_longest_suffix_wins():
    context = [2, 3, 4, 10, 11, 9, 2, 3, 4, 20, 21, 22, 8, 2, 3, 4]
    assert continuation(context, 2) == [20, 21]  # 2 3 4 occurred twice: the latest counts
    context = [1, 2, 3, 4, 10, 11, 12, 9, 2, 3, 4, 20, 7, 1, 2, 3, 4]
    assert MIN_NGRAM <= 3 and continuation(context, 3) == [10, 11, 12]  # the 4-gram match beats a later 3-gram one


def test_the_draft_stops_at_the_end_of_the_context():
    assert continuation([5, 6, 7, 8, 5, 6, 7], 10) == [8, 5, 6, 7]


def test_no_draft_without_a_long_enough_match():
    assert continuation([1, 2, 3, 4, 5], 4) == []
    short = list(range(MIN_NGRAM - 1))
    assert continuation([*short, 99, *short], 4) == []  # a match shorter than MIN_NGRAM does not count
    assert continuation([], 4) == [] and continuation([1, 2, 3], 0) == []


def test_first_difference_counts_the_right_tokens_of_a_draft():
    assert first_difference([1, 2, 3], [1, 2, 4, 5]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # all of a draft shorter than what was emitted
    assert first_difference([1, 2, 3], [1]) == 1 and first_difference([], [1]) == 0
