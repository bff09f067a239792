"""engine.core.buckets: which shapes a step takes in each token layout, and that warm-up's list
holds every one of them."""

from __future__ import annotations

import itertools

from engine.core.buckets import Bucket, ShapeBuckets, pow2

PADDED = ShapeBuckets(ragged=False, max_num_seqs=32, max_num_batched_tokens=512, prefill_chunk=128,
                      max_pages_per_seq=128, page_size=16)
RAGGED = ShapeBuckets(**{**PADDED.__dict__, "ragged": True})


def test_pow2():
    assert [pow2(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]


def test_padded_buckets_of_the_default_app():
    """48 shapes: decode-only Sd 1..32, prefill-only Sp 1..4, mixed (8 or 32) x Sp, x L 16..128."""
    assert PADDED.page_buckets == [16, 32, 64, 128]
    assert (PADDED.max_prefill_rows, PADDED.max_rows, PADDED.mixed_decode_rows) == (4, 36, [8, 32])
    assert len(PADDED.all()) == 15 * 4
    assert PADDED.for_step(3, [], 20) == Bucket(4, 4, 4, 32, 128)
    assert PADDED.for_step(0, [70, 5], 1) == Bucket(0, 2, 256, 16, 128)
    assert PADDED.for_step(9, [128], 1) == Bucket(32, 33, 160, 16, 128)  # 9 decodes pad to the top tier


def test_ragged_buckets_pack_tokens():
    assert RAGGED.page_buckets == [128]  # every page table spans max_model_len
    assert (RAGGED.max_prefill_rows, RAGGED.max_rows) == (32, 32)
    assert RAGGED.for_step(3, [], 20) == Bucket(0, 4, 4, 128, 0)
    assert RAGGED.for_step(0, [70, 5], 1) == Bucket(0, 2, 128, 128, 0)
    assert RAGGED.for_step(9, [128], 1) == Bucket(0, 16, 256, 128, 0)


def test_every_bucket_a_step_can_take_is_compiled_at_warm_up():
    for buckets in (PADDED, RAGGED):
        compiled = set(buckets.all())
        for decodes, prompts, chunk, pages in itertools.product(range(0, 33, 3), range(0, 5), (1, 77, 128),
                                                                (1, 17, 128)):
            if decodes + prompts == 0 or decodes + prompts > 32 or decodes + prompts * chunk > 512:
                continue
            assert buckets.for_step(decodes, [chunk] * prompts, pages) in compiled
