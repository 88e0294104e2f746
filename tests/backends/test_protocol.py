"""Every built-in backend implements the whole AttentionBackend protocol, page reads included."""

from __future__ import annotations

import pytest
import torch

from protocol_members import conformance_problems, protocol_members, without
from specdec.backends import available_backends, get_backend
from specdec.backends.base import AttentionBackend, AttentionMetadata

BUILT_IN = ("torch", "triton", "aiter")


@pytest.fixture(scope="module", params=BUILT_IN)
def backend(request):
    return get_backend(request.param)


def test_every_backend_is_built_in():
    assert sorted(BUILT_IN) == available_backends()


def test_backend_implements_every_member(backend):
    assert conformance_problems(backend, AttentionBackend) == []
    assert isinstance(backend, AttentionBackend)


def test_backend_name_is_the_one_it_is_selected_by(backend):
    assert get_backend(backend.name).name == backend.name


@pytest.mark.parametrize("member", sorted(protocol_members(AttentionBackend)))
def test_a_backend_lacking_any_member_fails_the_check(member):
    assert conformance_problems(without(get_backend("torch"), AttentionBackend, member), AttentionBackend) == [
        f"{member} is missing"
    ]


def test_a_data_member_of_the_wrong_type_fails_the_check():
    stand_in = without(get_backend("torch"), AttentionBackend, "supports_custom_mask")
    stand_in.supports_custom_mask = "yes"
    assert conformance_problems(stand_in, AttentionBackend) == ["supports_custom_mask is 'yes', not <class 'bool'>"]


def test_gather_pages_reads_back_what_write_kv_wrote(backend):
    # Two requests over shuffled 4-token pages of an entry one model reads itself ([index_head_dim]).
    block_size, width = 4, 3
    meta = AttentionMetadata.build(
        query_lens=[6, 3],
        seq_lens=[6, 3],
        block_tables=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([12, 13, 14, 15, 4, 5, 8, 9, 10]),
        block_size=block_size,
    )
    layer = {"k": torch.zeros(5, block_size, width)}
    keys = torch.randn(9, width, generator=torch.Generator().manual_seed(0))
    backend.write_kv(layer, {"k": keys}, meta.slot_mapping)
    gathered = backend.gather_pages(layer["k"], meta)
    assert gathered.shape == (2, 6, width)
    assert torch.equal(gathered[0], keys[:6]) and torch.equal(gathered[1, :3], keys[6:])
