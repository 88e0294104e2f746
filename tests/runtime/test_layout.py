"""``StepLayout``: one forward's rows per request, built once and read by runner, verifier and proposer."""

import pytest
import torch

from specdec.runtime.layout import StepLayout


def test_rows_positions_and_verify_rows():
    # Request 7: 2 rows from position 3, 1 of them a draft; request 9: a prefill of 4 rows; request 5:
    # 4 rows from position 10, 3 of them drafts.
    layout = StepLayout.build([7, 9, 5], [3, 0, 10], [2, 4, 4], [1, 0, 3])
    assert layout.row_starts == (0, 2, 6) and layout.num_rows == 10 and layout.seq_lens == [5, 4, 14]
    assert layout.positions.tolist() == [3, 4, 0, 1, 2, 3, 10, 11, 12, 13]
    # The verifier scores each request's last num_drafts + 1 rows, request-major.
    assert layout.verify_rows.tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert layout.kept_rows([1, 0, 2]) == [2, 4, 3]
    plain = StepLayout.build([1, 2], [5, 0], [1, 3])
    assert plain.num_drafts == (0, 0) and plain.verify_rows.tolist() == [0, 3]  # the rows that sample
    assert plain.positions.dtype == torch.long


@pytest.mark.parametrize(
    "args, needle",
    [
        (([1], [0, 1], [2], None), "one start position"),
        (([1], [0], [2], [2]), "at least one row more than it has drafts"),
        (([1], [0], [0], None), "at least one row"),
    ],
)
def test_inconsistent_layouts_are_refused(args, needle):
    with pytest.raises(ValueError, match=needle):
        StepLayout.build(*args)
