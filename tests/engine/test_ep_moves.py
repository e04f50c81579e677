"""Expert moves between EP ranks: the transfer list every rank derives from the old and new placement."""

from deepinfer_core.distributed.expert_moves import layer_transfers


def test_transfers_copy_locally_when_possible_and_fetch_from_the_lowest_holder():
    old = [0, 1, 2, 3, 0, 4, 5, 6]  # rank 0: slots 0-3, rank 1: slots 4-7
    new = [0, 4, 2, 1, 3, 4, 5, 4]
    remote, local = layer_transfers(old, new, 2)
    # rank 0 slot 1 wants 4 (held by rank 1 at local 1); rank 1 slot 0 wants 3 (rank 0 local 3);
    # rank 1 slot 3 wants 4, which rank 1 holds: a local copy
    assert sorted(remote) == [(0, 1, 1, 1), (1, 0, 0, 3)]
    assert sorted(local) == [(0, 3, 1), (1, 3, 1)]


def test_an_unchanged_placement_moves_nothing():
    assert layer_transfers([0, 1, 2, 3], [0, 1, 2, 3], 2) == ([], [])
