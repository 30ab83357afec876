"""Layouts as values: MindSpore's constructor, normalization, local parts, views, errors."""

import pytest
import torch

from autoshard import Factored, Layout, LayoutError


def owners(layout: Layout, dim: int) -> dict[int, tuple[int, ...]]:
    """For each rank, the global indices of ``dim`` it holds."""
    out = {}
    for rank in layout.ranks:
        index = layout.local_index(rank)[dim]
        if isinstance(index, slice):
            out[rank] = tuple(range(index.start, index.stop))
        else:
            out[rank] = tuple(index.tolist())
    return out


def test_seed_matmul_example_on_8_devices():
    # MatMul with strategy ((2,1),(1,4)): device matrix (2,1,4).
    x = Layout((2, 1, 4), (2, -1), (8, 16))
    w = Layout((2, 1, 4), (-1, 0), (16, 8))
    x_rows = owners(x, 0)
    assert all(x_rows[r] == tuple(range(4)) for r in range(4))
    assert all(x_rows[r] == tuple(range(4, 8)) for r in range(4, 8))
    w_cols = owners(w, 1)
    for part in range(4):
        assert w_cols[part] == w_cols[part + 4] == tuple(range(2 * part, 2 * part + 2))
    assert x.local_shape(0) == (4, 16) and w.local_shape(5) == (16, 2)


def test_equal_placements_are_equal_values():
    a = Layout((2, 1, 4), (2, -1), (8, 16))
    b = Layout((2, 4), (1, -1), (8, 16))
    assert a == b and hash(a) == hash(b)
    assert Layout((2, 2), ((1, 0), -1), (8, 4)) == Layout((4,), (0, -1), (8, 4))
    assert Layout((2, 2), ((0, 1), -1), (8, 4)) != Layout((4,), (0, -1), (8, 4))
    assert Layout((2, 2), (-1, -1), (8, 4), partial=(0, 1)) == Layout(
        (4,), (-1, -1), (8, 4), partial=(0,)
    )
    assert len({a, b}) == 1
    assert a.mesh == (2, 4) and a.tensor_map == (1, -1)  # the normalized MindSpore form
    assert Layout((2, 2), ((0, 1), -1), (8, 4)).tensor_map == ((0, 1), -1)
    import pickle

    factored = Layout((2, 2), (Factored((3, 4), (-1, 1)), -1), (12, 4), partial=(0,))
    assert pickle.loads(pickle.dumps(factored)) == factored
    with pytest.raises(AttributeError):
        a.shape = (1, 1)
    # the internal form is normalized once for equal arguments: the same value, shared
    made = Layout.from_factors(
        (8, 16), (2, 4), [[(2, 0), (4, -1)], [(16, -1)]], (), None, torch.float32
    )
    again = Layout.from_factors((8, 16), [2, 4], ([(2, 0), (4, -1)], [(16, -1)]), [])
    assert made is again and made == b and made.tensor_map == (1, -1)
    other = Layout.from_factors(
        (8, 16), (2, 4), [[(2, 0), (4, -1)], [(16, -1)]], dtype=torch.bfloat16
    )
    assert other is not made and other != made and other.dtype == torch.bfloat16
    with pytest.raises(LayoutError):  # a bad one is refused each time, never kept
        Layout.from_factors((8, 16), (2, 4), [[(8, 0)], [(16, -1)]])
    with pytest.raises(LayoutError):
        Layout.from_factors((8, 16), (2, 4), [[(8, 0)], [(16, -1)]])


def test_from_strategy_appends_the_repeat_factor_on_the_right():
    layout = Layout.from_strategy((8, 4), (2, 1), 4)
    assert owners(layout, 0)[0] == owners(layout, 0)[1] == tuple(range(4))
    assert owners(layout, 0)[2] == tuple(range(4, 8))


def test_named_form_and_str():
    mesh = {"dp": 2, "tp": 2}
    layout = Layout.from_named((8, 16), ("dp", "tp"), mesh)
    assert str(layout) == "f32[8@dp,16@tp]"
    assert layout == Layout((2, 2), (1, 0), (8, 16))
    both = Layout.from_named((8, 16), (("tp", "dp"), None), mesh, dtype=torch.float64)
    assert str(both) == "f64[8@(tp,dp),16]"
    assert owners(both, 0)[1] == tuple(range(4, 6))  # rank 1 = (dp 0, tp 1): tp is major
    partial = Layout.from_named((8, 16), (None, None), mesh, partial=("tp",))
    assert str(partial) == "f32[8,16]{partial:tp}" and partial.partial == (1,)


def test_factored_dim_holds_each_rank_heads_of_q_k_and_v():
    num_heads, head_dim, hidden = 4, 2, 8
    layout = Layout.from_named(
        (3 * num_heads * head_dim, hidden),
        (Factored((3, num_heads, head_dim), (None, "tp", None)), None),
        {"tp": 2},
    )
    rows = owners(layout, 0)
    per_block = num_heads * head_dim
    expected_0 = tuple(q * per_block + i for q in range(3) for i in range(4))
    assert rows[0] == expected_0
    assert rows[1] == tuple(i + 4 for i in expected_0)
    assert layout.local_shape() == (12, hidden)
    assert str(layout) == "f32[(3,8@tp),8]"
    q = layout.chunk(0, 3, 0)
    assert q == Layout.from_named((per_block, hidden), ("tp", None), {"tp": 2})
    heads = layout.view((3, num_heads, head_dim, hidden))
    assert heads == Layout.from_named(
        (3, num_heads, head_dim, hidden), (None, "tp", None, None), {"tp": 2}
    )
    assert heads.view((3 * num_heads * head_dim, hidden)) == layout


def test_views_keep_splits_or_fail_clearly():
    layout = Layout.from_named((4, 6, 8), ("dp", None, "tp"), {"dp": 2, "tp": 2})
    flat = layout.view((24, 8))
    assert flat == Layout.from_named((24, 8), ("dp", "tp"), {"dp": 2, "tp": 2})
    assert flat.view((4, 6, 8)) == layout
    assert layout.view((4, 6, 2, 4)).factors[2] == ((2, 1),)
    assert layout.permute((2, 0, 1)) == Layout.from_named(
        (8, 4, 6), ("tp", "dp", None), {"dp": 2, "tp": 2}
    )
    assert layout.transpose(0, 2).shape == (8, 6, 4)
    seq = Layout.from_named((2, 8, 4), (None, "cp", None), {"cp": 4})
    merged = seq.view((16, 4))  # batch*seq with the sequence split: a strided layout
    assert str(merged) == "f32[(2,8@cp),4]"
    strided = Layout.from_named((4, 8), (None, "tp"), {"tp": 4}).view((2, 16))
    assert str(strided) == "f32[2,(2,8@tp)]"
    with pytest.raises(LayoutError, match="would cut the factor of size 4 split over tp"):
        Layout.from_named((8,), ("tp",), {"tp": 4}).view((2, 4))
    with pytest.raises(LayoutError, match="not divisible"):
        layout.chunk(1, 4, 0)


def test_local_index_reconstructs_the_tensor():
    full = torch.arange(2 * 3 * 4 * 8, dtype=torch.float64).reshape(6, 4, 8)
    layout = Layout((2, 2, 2), (Factored((3, 2), (-1, 2)), 1, 0), (6, 4, 8))
    seen = torch.zeros_like(full)
    for rank in layout.ranks:
        index = layout.local_index(rank)
        local = full
        for dim, ix in enumerate(index):
            ix = torch.arange(ix.start, ix.stop) if isinstance(ix, slice) else ix
            local = local.index_select(dim, ix)
        assert tuple(local.shape) == layout.local_shape(rank)
        grid = torch.meshgrid(
            *[
                torch.as_tensor(list(range(i.start, i.stop)) if isinstance(i, slice) else i)
                for i in index
            ],
            indexing="ij",
        )
        seen[grid] += 1
    assert torch.equal(seen, torch.ones_like(full))


def anew(layout, ranks, dtype):
    """``layout`` built again from its parts, normalized, on ``ranks`` in ``dtype``."""
    return Layout.from_factors(
        layout.shape, layout.mesh, layout.factors, layout.partial, ranks, dtype, layout.axis_names
    )


def test_another_dtype_or_rank_list_is_the_layout_built_anew_with_it():
    layouts = [
        Layout((2, 1, 4), (2, -1), (8, 16)),
        Layout((2, 2), (Factored((3, 4), (-1, 1)), -1), (12, 4), partial=(0,)),
        Layout((2, 2), ((0, 1), -1), (8, 4), axis_names=("dp", "tp")),
    ]
    for layout in layouts:
        for dtype in (torch.bfloat16, torch.float32):
            made = anew(layout, layout.ranks, dtype)
            got = layout.with_dtype(dtype)
            assert got == made and hash(got) == hash(made) and repr(got) == repr(made)
        moved = layout.on_ranks(range(4, 4 + len(layout.ranks)))
        made = anew(layout, tuple(range(4, 4 + len(layout.ranks))), layout.dtype)
        assert moved == made and repr(moved) == repr(made) and moved.ranks is made.ranks
        assert moved.local_shape(4) == layout.local_shape(0)


def test_rank_subset_and_non_power_of_two():
    stage = Layout((2, 2), (1, -1), (8, 4), ranks=(4, 5, 6, 7))
    assert owners(stage, 0)[6] == tuple(range(4, 8))
    assert str(stage).endswith("on[4, 5, 6, 7]")
    with pytest.raises(LayoutError, match="rank 0 is not in"):
        stage.local_shape(0)
    three = Layout((3, 2), (1, 0), (9, 4))
    assert three.local_shape() == (3, 2) and owners(three, 0)[5] == (6, 7, 8)


@pytest.mark.parametrize(
    "args, match",
    [
        (((2, 4), (0, -1), (6, 16)), r"\[6,16\] dim 0: size 6 is not divisible by its split 4"),
        (((2, 4), (1, -1), (8, 16, 2)), "has 2 entries but the tensor shape"),
        (((2, 4), (2, -1), (8, 16)), "names no axis of device matrix"),
        (((2, 4), (1, 1), (8, 16)), "splits both dim 0 and dim 1"),
    ],
)
def test_invalid_layouts_name_what_is_wrong(args, match):
    with pytest.raises(LayoutError, match=match):
        Layout(*args)


def test_invalid_strategy_names_shape_split_and_devices():
    with pytest.raises(ValueError, match=r"strategy \(4, 2\) for tensor \[8,8\] uses 8 devices.*4"):
        Layout.from_strategy((8, 8), (4, 2), 4)
    with pytest.raises(ValueError, match=r"dim 1: size 5 is not divisible by its split 2"):
        Layout.from_strategy((8, 5), (1, 2), 4)
    with pytest.raises(LayoutError, match="axis names"):
        Layout.from_named((8,), ("pp",), {"dp": 2})


def test_dtensor_placements_round_trip():
    from torch.distributed.tensor import Partial, Replicate, Shard

    class FakeMesh:
        mesh_dim_names = ("dp", "tp")
        mesh = torch.arange(4).reshape(2, 2)

    mesh = FakeMesh()
    layout = Layout.from_named((8, 16), ("tp", None), {"dp": 2, "tp": 2}, partial=("dp",))
    placements = layout.to_placements(mesh)
    assert placements == (Partial(), Shard(0))
    assert Layout.from_placements(placements, mesh, (8, 16)) == layout
    both = Layout.from_named((8, 16), (("dp", "tp"), None), {"dp": 2, "tp": 2})
    assert both.to_placements(mesh) == (Shard(0), Shard(0))
    assert Layout.from_placements((Replicate(), Replicate()), mesh, (8, 16)) == Layout.replicated(
        (8, 16), 4
    )
    with pytest.raises(LayoutError, match="cannot express"):
        Layout.from_named((8, 16), (("tp", "dp"), None), {"dp": 2, "tp": 2}).to_placements(mesh)

    class SizeOneMesh(FakeMesh):
        mesh = torch.arange(2).reshape(2, 1)

    # a size-1 mesh dim holds the whole value: Replicate, never Partial (DCP refuses partials)
    one = SizeOneMesh()
    assert Layout.replicated((8, 16), 2).to_placements(one) == (Replicate(), Replicate())
    summed = Layout.from_named((8, 16), ("dp", None), {"dp": 2, "tp": 1}, partial=("tp",))
    assert summed.to_placements(one) == (Shard(0), Replicate())
