"""The multi-rank harness reports a rank's failure: a harness that swallowed it would make every
multi-rank test pass vacuously (each rank leaves through `os._exit`)."""
import pytest

from tests.ranks import spawn_ranks


def _fails_on_rank1(rank: int, path: str) -> None:
    open(f"{path}/rank{rank}", "w").write("done")
    assert rank == 0, "rank 1 fails"


def test_a_rank_that_fails_fails_the_spawn(tmp_path):
    with pytest.raises(Exception, match="rank 1 fails"):
        spawn_ranks(_fails_on_rank1, 2, str(tmp_path))
    assert (tmp_path / "rank0").read_text() == "done"  # the rank that passed wrote before it left
