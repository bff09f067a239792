"""engine.step.buckets: the ladder of step shapes (and engine.ladder, which it climbs), which
bucket a step takes, and that a step only takes a bucket that is ready."""

from __future__ import annotations

import itertools

import pytest

from engine.ladder import ladder
from engine.step.buckets import Bucket, ShapeBuckets, pow2

DEFAULT = ShapeBuckets(max_num_seqs=32, max_num_batched_tokens=512, max_pages_per_seq=128, page_size=16)


def test_pow2():
    assert [pow2(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]


def test_the_default_config_compiles_eight_programs_whatever_max_model_len():
    assert DEFAULT.token_ladder == [1, 8, 16, 32, 64, 128, 256, 512]
    assert DEFAULT.all() == [Bucket(1, 1), Bucket(8, 8), Bucket(16, 16), Bucket(32, 32), Bucket(64, 32),
                             Bucket(128, 32), Bucket(256, 32), Bucket(512, 32)]
    longer = ShapeBuckets(max_num_seqs=32, max_num_batched_tokens=512, max_pages_per_seq=8192, page_size=16)
    assert longer.all() == DEFAULT.all()


def test_the_first_program_compiled_holds_a_full_batch_of_decodes():
    assert DEFAULT.compile_order() == [Bucket(32, 32), Bucket(1, 1), Bucket(8, 8), Bucket(16, 16), Bucket(64, 32),
                                       Bucket(128, 32), Bucket(256, 32), Bucket(512, 32)]
    assert ShapeBuckets(4, 24, 32, 4).compile_order()[0] == Bucket(8, 4)


def test_the_ladder_ends_at_the_budget_itself():
    assert ShapeBuckets(4, 24, 32, 4).token_ladder == [1, 8, 16, 24]
    assert ShapeBuckets(4, 4, 32, 4).token_ladder == [1, 4]
    assert ShapeBuckets(4, 1, 32, 4).token_ladder == [1]
    assert ShapeBuckets(64, 2048, 128, 16).token_ladder == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def test_the_shared_ladder_climbs_by_its_factor_and_ends_at_the_top():
    """engine.ladder, which the three engines' ladders climb."""
    assert ladder(1, 100, 4) == [1, 4, 16, 64, 100]
    assert ladder(16, 100) == [16, 32, 64, 100]
    assert ladder(16, 64) == [16, 32, 64]
    assert ladder(16, 10) == [10]
    assert ladder(1, 1) == [1]


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    assert DEFAULT.for_step(1, 1) == Bucket(1, 1)
    assert DEFAULT.for_step(3, 3) == Bucket(8, 8)
    assert DEFAULT.for_step(33, 1) == Bucket(64, 1)  # one prompt of 33 tokens: one row of logits
    assert DEFAULT.for_step(40, 9) == Bucket(64, 16)
    assert DEFAULT.for_step(512, 32) == Bucket(512, 32)
    with pytest.raises(ValueError, match="no compiled bucket holds a step of 513 tokens"):
        DEFAULT.for_step(513, 1)


def test_only_ready_buckets_are_taken():
    ready = [Bucket(32, 32), Bucket(512, 32)]
    assert DEFAULT.for_step(1, 1, ready) == Bucket(32, 32)
    assert DEFAULT.for_step(40, 2, ready) == Bucket(512, 32)
    assert DEFAULT.for_step(40, 2, ready + [Bucket(1, 1), Bucket(8, 8)]) == Bucket(512, 8)
    with pytest.raises(ValueError, match="have \\[Bucket\\(tokens=32, samples=32\\)\\]"):
        DEFAULT.for_step(40, 2, ready[:1])


def test_every_step_the_scheduler_can_make_has_a_bucket():
    """A step has at most max_num_seqs rows (one per sequence), each of at least one token; the
    forward program comes from its tokens and the LM head's from its rows, each of the compile units."""
    units = DEFAULT.all()
    for tokens, rows in itertools.product(range(1, 513), (1, 2, 7, 31, 32)):
        if rows <= tokens:
            bucket = DEFAULT.for_step(tokens, rows)
            assert bucket.tokens >= tokens and bucket.samples >= rows
            assert bucket.tokens in {b.tokens for b in units} and bucket.samples in {b.samples for b in units}
