"""Boxes of a safetensors tensor read by positioned reads of their byte runs (``automodel.loading.direct_read``)
equal safetensors' own slicing, for every box of small tensors, with and without a cast, and with a staging buffer
smaller than one run; non-contiguous index sets (a ``StridedShard``'s, a packed projection's) read part by part."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from automodel.loading import direct_read
from automodel.loading.checkpoint_files import open_safetensors_file
from automodel.loading.sources import StoredTensor

SHAPES = [(), (7,), (5, 6), (3, 4, 5), (2, 3, 2, 4)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "model.safetensors"
    generator = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(shape, generator=generator).to(torch.bfloat16) for i, shape in enumerate(SHAPES)}
    tensors["ints"] = torch.arange(60, dtype=torch.int32).reshape(6, 10)
    save_file(tensors, path)
    return path, tensors


def _boxes(shape: tuple[int, ...]):
    per_dim = [[(lo, hi) for lo in range(size) for hi in range(lo + 1, size + 1)] for size in shape]
    yield from itertools.product(*per_dim)


@pytest.mark.parametrize("key", [f"t{i}" for i in range(len(SHAPES))] + ["ints"])
@pytest.mark.parametrize("dtype", ["stored", torch.float32])
def test_every_box_reads_as_safetensors_slices_it(stored, key, dtype):
    path, tensors = stored
    files = open_safetensors_file(path)
    expected_full = tensors[key]
    target = expected_full.dtype if dtype == "stored" else dtype
    with safe_open(path, "pt") as handle:
        for box in _boxes(tuple(expected_full.shape)):
            slices = tuple(slice(lo, hi) for lo, hi in box)
            expected = handle.get_slice(key)[slices] if slices else handle.get_tensor(key)
            out = torch.empty(expected.shape, dtype=target)
            assert files.read_into(key, slices, out)
            assert torch.equal(out, expected.to(target)), (key, box)
    files.close()


def test_uneven_spans_are_gathered_run_by_run(stored):
    """A 3-D box partial in its last two dims: runs evenly spaced within a row block, with a jump between blocks."""
    path, tensors = stored
    files = open_safetensors_file(path)
    box = (slice(0, 2), slice(1, 3), slice(1, 4))
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(2, 2, 3, dtype=dtype)
        assert files.read_into("t3", box, out)
        assert torch.equal(out, tensors["t3"][box].to(dtype))
    files.close()


def test_a_cast_read_stages_at_most_the_bound(stored, monkeypatch):
    path, tensors = stored
    monkeypatch.setattr(direct_read, "STAGING_BYTES", 4)  # smaller than one run: each run is read in pieces
    files = open_safetensors_file(path)
    out = torch.empty(3, 2, 5, dtype=torch.float32)
    assert files.read_into("t3", (slice(0, 3), slice(1, 3)), out)
    assert torch.equal(out, tensors["t3"][:, 1:3].float())
    files.close()


def test_a_dim1_shard_reads_its_rows_as_one_span_or_run_by_run(stored, monkeypatch):
    """The column band of a 2-D tensor: short runs close together are one read of their span (bounded by
    ``SPAN_AMPLIFICATION`` times the bytes wanted); without that, one read per row of exactly its own bytes."""
    path, tensors = stored
    box = (slice(0, 5), slice(2, 4))
    for amplification, expected_bytes in ((direct_read.SPAN_AMPLIFICATION, (4 * 6 + 2) * 2), (1, 5 * 2 * 2)):
        monkeypatch.setattr(direct_read, "SPAN_AMPLIFICATION", amplification)
        files = open_safetensors_file(path)
        out = torch.empty(5, 2, dtype=torch.bfloat16)
        files.read_into("t2", box, out)
        assert files.bytes_read == out.numel() * out.element_size()
        assert files.bytes_spanned == expected_bytes
        assert torch.equal(out, tensors["t2"][box])
        files.close()


def test_index_sets_of_several_runs_read_part_by_part(stored):
    path, tensors = stored
    files = open_safetensors_file(path)
    source = StoredTensor(files, "t3", (3, 4, 5))
    indices = [torch.tensor([0, 2]), torch.tensor([0, 1, 3]), torch.tensor([1, 2, 4])]
    expected = tensors["t3"][indices[0]][:, indices[1]][:, :, indices[2]]
    out = torch.empty(2, 3, 3, dtype=torch.float32)
    source.read_into(indices, out)
    assert torch.equal(out, expected.float())
    assert torch.equal(source.read(indices), expected)
    files.close()


@pytest.mark.parametrize("gap", [direct_read.MAX_GAP, direct_read.MAX_GAP + 2])
def test_gaps_up_to_max_gap_are_read_past_and_wider_ones_are_not(gap):
    """Rows of ``MAX_GAP`` bytes (so that ``SPAN_AMPLIFICATION`` does not bind): a gap of ``MAX_GAP`` (a page) is read
    past, one element more is one read per row."""
    length, rows = direct_read.MAX_GAP, 6
    offsets = torch.arange(rows, dtype=torch.int64) * (length + gap)
    out = torch.empty(rows * length // 2, dtype=torch.bfloat16, device="meta")
    (chunk,) = direct_read.plan_chunks(-1, offsets, length, torch.bfloat16, out)
    if gap <= direct_read.MAX_GAP:
        assert chunk.calls == [0] and chunk.spanned == rows * length + (rows - 1) * gap
    else:
        assert chunk.calls == list(range(rows)) and chunk.spanned == rows * length
