"""A batch mixing a prompt with decoding requests, cut into groups of close query lengths."""

import attrs
import pytest
import torch

from specdec.backends import ragged
from specdec.backends.base import AttentionMetadata

# 16 verifies of 4 queries, 3 decodes, one 70-token prompt and one 90-token chunk, interleaved.
QUERY_LENS = [4, 4, 1, 70, 4, 4, 4, 1, 4, 4, 90, 4, 4, 4, 4, 1, 4, 4, 4, 4, 4]
SEQ_LENS = [q + 13 * i % 50 for i, q in enumerate(QUERY_LENS)]


def alone(meta: AttentionMetadata, request: int) -> AttentionMetadata:
    """Request ``request`` of ``meta`` as a batch of its own."""
    start, end = meta.query_start_loc[request : request + 2].tolist()
    return AttentionMetadata.build(
        query_lens=[end - start], seq_lens=[int(meta.seq_lens[request])],
        block_tables=meta.block_tables[request : request + 1], slot_mapping=meta.slot_mapping[start:end],
        block_size=meta.block_size,
    )


def test_a_prompt_is_cut_from_the_decoding_requests(paged_case):
    meta = paged_case(seq_lens=SEQ_LENS, query_lens=QUERY_LENS, block_size=8, num_heads=2, num_kv_heads=1,
                      head_dim=4).meta
    groups = ragged.query_groups(meta)
    assert groups is not None and len(groups) >= 2
    seen = torch.cat([g.tokens for g in groups]).sort().values
    assert seen.tolist() == list(range(meta.num_query_tokens))  # every token exactly once
    for group in groups:
        requests = group.requests.tolist()
        assert requests == sorted(requests)
        assert group.meta.query_lens.tolist() == [QUERY_LENS[i] for i in requests]
        assert group.meta.seq_lens.tolist() == [SEQ_LENS[i] for i in requests]
        assert torch.equal(group.meta.slot_mapping, meta.slot_mapping[group.tokens])
        lens = group.meta.query_lens
        assert len(lens) * int(lens.max()) - int(lens.sum()) <= ragged.SLACK * int(lens.sum()) + ragged.ALLOWANCE
    # The prompt and the chunk leave the short requests' group.
    short = next(g for g in groups if 0 in g.requests.tolist())
    assert 3 not in short.requests.tolist() and 10 not in short.requests.tolist()
    assert ragged.query_groups(meta) is groups  # once per forward


def test_decoding_requests_are_cut_from_a_verifying_one(paged_case):
    # Drafts for one request of 16 (an adaptive controller's choice): padding the others to its 4
    # queries would be 45 rows of waste.
    query_lens = [1] * 7 + [4] + [1] * 8
    meta = paged_case(seq_lens=[q + 9 for q in query_lens], query_lens=query_lens, block_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=4).meta
    groups = ragged.query_groups(meta)
    assert [g.requests.tolist() for g in groups] == [[i for i in range(16) if i != 7], [7]]


@pytest.mark.parametrize("query_lens", [[4] * 8, [1] * 8, [40, 35, 38], [4, 4, 3, 4, 2, 4]])
def test_a_batch_that_pads_little_stays_whole(paged_case, query_lens):
    meta = paged_case(seq_lens=[q + 5 for q in query_lens], query_lens=query_lens, block_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=4).meta
    assert ragged.query_groups(meta) is None


@pytest.mark.parametrize("mla", [False, True])
def test_grouped_attention_equals_each_request_alone(paged_case, mla_case, torch_backend, mla):
    """Output and LSE, with a custom mask, in float64: exactly what each request gets on its own (the
    torch backend reads padding slots, so they hold zeros here, not the kernels tests' NaN poison)."""
    if mla:
        case = mla_case(seq_lens=SEQ_LENS, query_lens=QUERY_LENS, block_size=8, num_heads=4, kv_lora_rank=12,
                        rope_dim=4, dtype=torch.float64, poison=0.0)
        attend = lambda q, meta: torch_backend.mla_attention(  # noqa: E731
            q, case.k_cache, meta, kv_lora_rank=12, scale=0.3, return_lse=True)
    else:
        case = paged_case(seq_lens=SEQ_LENS, query_lens=QUERY_LENS, block_size=8, num_heads=4, num_kv_heads=2,
                          head_dim=8, dtype=torch.float64, poison=0.0)
        attend = lambda q, meta: torch_backend.attention(  # noqa: E731
            q, case.k_cache, case.v_cache, meta, scale=0.3, return_lse=True)
    g = torch.Generator().manual_seed(5)
    custom = torch.rand(case.meta.num_query_tokens, case.meta.max_seq_len, generator=g) < 0.7
    out, lse = attend(case.q, attrs.evolve(case.meta, custom_mask=custom))
    starts = case.meta.query_start_loc.tolist()
    for i in range(len(QUERY_LENS)):
        rows = slice(starts[i], starts[i + 1])
        single = alone(case.meta, i)
        ref, ref_lse = attend(case.q[rows], attrs.evolve(single, custom_mask=custom[rows, : SEQ_LENS[i]]))
        torch.testing.assert_close(out[rows], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-12, atol=1e-12)
