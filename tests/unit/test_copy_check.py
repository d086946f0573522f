"""scripts/copy_check.py: which tokens a copy lesson's calls are, and when a call counts as copied."""

from scripts.copy_check import call_spans, copied_calls


def test_the_calls_are_the_runs_of_trained_tokens_in_order():
    assert call_spans([0, 0, 1, 1, 0, 0, 1, 1, 1]) == [(2, 4), (6, 9)]
    assert call_spans([1, 0, 1]) == [(0, 1), (2, 3)]
    assert call_spans([0, 0]) == []


def test_a_call_is_copied_only_when_every_token_of_it_is_the_one_predicted():
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    mask = [0, 0, 1, 1, 0, 0, 1, 1]
    shifted = ids[1:] + [0]  # predicted[j - 1] == ids[j] everywhere: both calls copied
    assert copied_calls(shifted, ids, mask) == [None, None]
    wrong_answer = list(shifted)
    wrong_answer[6] = 99  # the prediction for ids[7], the answer call's last token
    assert copied_calls(wrong_answer, ids, mask) == [None, 7]
    wrong_untrained = list(shifted)
    wrong_untrained[3] = 99  # the prediction for ids[4], a token no call trains: not counted
    assert copied_calls(wrong_untrained, ids, mask) == [None, None]
    both = list(shifted)
    both[1], both[5] = 99, 99  # the first token of each call
    assert copied_calls(both, ids, mask) == [2, 6]
