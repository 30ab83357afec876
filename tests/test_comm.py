"""The counting layer over torch's collectives (comm): ring byte formulas, values of every
collective on 2 and 4 ranks, the counters, and chunks in the caller's rank order.

Every case of one world size runs in one spawn; each rank checks its own results against values
it computes locally for every rank, so a wrong chunk order shows up as a wrong value.
"""

from __future__ import annotations

import pytest
import torch

from autoshard import comm
from autoshard.comm import collective_bytes
from autoshard.testing import run_ranks

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@pytest.mark.parametrize("group", [2, 3, 4, 8])
def test_collective_bytes_are_the_ring_formulas(group: int) -> None:
    """What one rank sends, from its local input size: the ring all-reduce sends 2 (g-1)/g of
    it, all-gather (g-1) times it, reduce-scatter and all-to-all (g-1)/g, a send all of it."""
    nbytes = 8 * 3 * 5 * 7  # divisible by every group size here
    g = group
    expected = {
        "all_reduce": 2 * (g - 1) * nbytes // g,
        "all_gather": (g - 1) * nbytes,
        "reduce_scatter": (g - 1) * nbytes // g,
        "all_to_all": (g - 1) * nbytes // g,
        "send_recv": nbytes,
    }
    assert {k: collective_bytes(k, g, nbytes) for k in KINDS} == expected


def test_collective_bytes_known_values_group_of_one_and_unknown_kind() -> None:
    """Spot values for 4 ranks and 1 KiB, nothing sent in a group of one, unknown kinds
    refused."""
    assert collective_bytes("all_reduce", 4, 1024) == 1536
    assert collective_bytes("all_gather", 4, 1024) == 3072
    assert collective_bytes("reduce_scatter", 4, 1024) == 768
    assert collective_bytes("all_to_all", 4, 1024) == 768
    assert collective_bytes("send_recv", 2, 1024) == 1024
    assert collective_bytes("broadcast", 4, 1024) == 1024  # the root's bytes, once
    assert all(collective_bytes(k, 1, 1024) == 0 for k in (*KINDS, "broadcast"))
    with pytest.raises(ValueError, match="'gather'"):
        collective_bytes("gather", 2, 1024)
    with pytest.raises(ValueError, match="'gather'"):
        collective_bytes("gather", 1, 1024)  # refused even where nothing would be sent


# -- on ranks ---------------------------------------------------------------------------------


def _value(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor rank ``rank`` contributes: distinct per rank and element, exact in float64."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000.0 * rank).reshape(shape)


def _counted(kind: str, group: int, tensor: torch.Tensor, call) -> torch.Tensor:
    """Run one collective under ``comm.counting`` and check it recorded exactly one call of
    ``kind`` with the bytes of ``collective_bytes`` for ``tensor`` (the local input)."""
    with comm.counting() as counted:
        out = call()
    nbytes = tensor.numel() * tensor.element_size()
    want = {kind: {"calls": 1, "bytes": collective_bytes(kind, group, nbytes)}}
    assert counted == want, (kind, group, counted, want)
    assert comm.counters() == want
    return out


def _check_group(ranks: tuple[int, ...]) -> None:
    """Every collective over ``ranks`` (in the caller's order, not necessarily ascending)."""
    import torch.distributed as dist

    me = dist.get_rank()
    if me not in ranks:
        return
    g = len(ranks)
    pos = ranks.index(me)
    x = _value(me, (3, 4))

    out = _counted("all_reduce", g, x, lambda: comm.all_reduce(x, ranks))
    assert torch.equal(out, sum(_value(r, (3, 4)) for r in ranks)), ranks
    assert torch.equal(x, _value(me, (3, 4))), "all_reduce must not write its input"

    y = x.clone()
    out = _counted("all_reduce", g, y, lambda: comm.all_reduce_(y, ranks))
    assert out is y and torch.equal(y, sum(_value(r, (3, 4)) for r in ranks)), ranks

    out = _counted("all_gather", g, x, lambda: comm.all_gather(x, ranks))
    assert torch.equal(out, torch.stack([_value(r, (3, 4)) for r in ranks])), ranks

    # chunk i of every member's input is summed onto ranks[i]
    chunks = _value(me, (g, 2, 3))
    out = _counted("reduce_scatter", g, chunks, lambda: comm.reduce_scatter(chunks, ranks))
    assert torch.equal(out, sum(_value(r, (g, 2, 3))[pos] for r in ranks)), ranks

    # chunk i goes to ranks[i]; result j came from ranks[j] (its chunk for this rank)
    out = _counted("all_to_all", g, chunks, lambda: comm.all_to_all(chunks, ranks))
    assert torch.equal(out, torch.stack([_value(r, (g, 2, 3))[pos] for r in ranks])), ranks

    if g > 1:  # a ring in the caller's order: send to the next member, receive from the last
        nxt, prev = ranks[(pos + 1) % g], ranks[(pos - 1) % g]
        like = torch.empty(3, 4, dtype=torch.float64)
        out = _counted("send_recv", 2, x, lambda: comm.send_recv(x, [nxt], prev, like))
        assert torch.equal(out, _value(prev, (3, 4))), ranks


def _comm_body() -> int:
    """All the cases of one world size; returns how many groups this rank took part in."""
    import torch.distributed as dist

    world = dist.get_world_size()
    me = dist.get_rank()
    groups = [
        tuple(range(world)),  # the world, ascending
        tuple(reversed(range(world))),  # the world, descending
        (me,),  # a group of one: the values are the input, nothing is sent
    ]
    if world == 4:
        groups += [(2, 0, 3, 1), (1, 3, 0, 2)]  # shuffled orders of the world
        groups += [(2, 0) if me % 2 == 0 else (3, 1)]  # subgroups, each descending
        groups += [(0, 1) if me < 2 else (3, 2)]  # one ascending, one descending
    done = 0
    for ranks in groups:
        _check_group(ranks)
        done += me in ranks
    # counters add up over calls until counting() or reset_counters() starts again
    x = _value(me, (5,))
    with comm.counting() as counted:
        comm.all_reduce(x, tuple(range(world)))
        comm.all_reduce(x, tuple(range(world)))
    assert counted == {
        "all_reduce": {"calls": 2, "bytes": 2 * collective_bytes("all_reduce", world, 40)}
    }
    comm.reset_counters()
    assert comm.counters() == {}
    dist.barrier()
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_values_counters_and_rank_order(world: int) -> None:
    """Each collective's values match torch computed locally, the counters record one call and
    exactly collective_bytes for it, and non-ascending groups return chunks in their order."""
    results = run_ranks(_comm_body, world, timeout=180)
    assert results == [3 if world == 2 else 7] * world


def test_recordings_nest_and_each_sees_its_own_block() -> None:
    from autoshard import comm

    with comm.recording() as outer:
        with comm.recording() as inner:
            pass  # closed while both are empty, so equal: the outer one must stay open
        comm._count("all_reduce", (0, 1), torch.zeros(4))
    assert inner == [] and outer == [("all_reduce", 2, 16)]
