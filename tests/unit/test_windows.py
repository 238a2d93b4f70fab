"""Strided perplexity windows: every target token scored exactly once, worked by hand."""

import pytest
from engines.protocol import WindowSpec, strided_windows


def targets(windows):
    out = []
    for _begin, end, n in windows:
        out.extend(range(end - n + 1, end + 1))
    return out


def test_disjoint_windows_by_hand():
    # seq = [start, t1..t10]; window 4 feeds seq[0:4] and scores t1..t4, then seq[4:8] → t5..t8; the last
    # window scores t9, t10 with a full window of context, seq[6:10] = t6..t9, as lm-eval's rolling windows
    # do (get_rolling_token_windows: input token_list[end − max_len − 1 : end − 1]), not seq[8:10]
    assert strided_windows(10, WindowSpec(4, 4)) == [(0, 4, 4), (4, 8, 4), (6, 10, 2)]


def test_strided_windows_by_hand():
    # stride 2: the second window feeds seq[2:6] and scores only t5, t6 (t3, t4 were scored already)
    assert strided_windows(10, WindowSpec(4, 2)) == [(0, 4, 4), (2, 6, 2), (4, 8, 2), (6, 10, 2)]


@pytest.mark.parametrize("n,max_len,stride", [(1, 4, 4), (7, 4, 1), (100, 16, 5), (16, 16, 16), (17, 16, 8)])
def test_each_target_scored_once(n, max_len, stride):
    ws = strided_windows(n, WindowSpec(max_len, stride))
    assert targets(ws) == list(range(1, n + 1))
    assert all(end - begin <= max_len and 1 <= k <= end - begin for begin, end, k in ws)


def test_window_spec_rejects_bad_stride():
    with pytest.raises(ValueError, match="stride"):
        WindowSpec(8, 9)
    with pytest.raises(ValueError, match="max_length"):
        WindowSpec(1, 1)
