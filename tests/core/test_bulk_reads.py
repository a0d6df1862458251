"""kvflow.core.state.bulk: the C-level bulk reads the legality checks use, against their plain forms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.state.bulk import all_in, values_at

keys = st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=20)


@given(present=keys, asked=keys)
def test_bulk_reads_agree_with_their_plain_forms(present: list[int], asked: list[int]) -> None:
    mapping = {k: k % 97 for k in present}
    asked_t = tuple(asked)
    assert all_in(mapping, asked_t) == all(k in mapping for k in asked_t)
    if all(k in mapping for k in asked_t):
        assert values_at(mapping, asked_t) == tuple(mapping[k] for k in asked_t)
    else:
        with pytest.raises(KeyError):
            values_at(mapping, asked_t)


def test_one_key_gives_a_one_tuple_and_no_keys_an_empty_one() -> None:
    # (itemgetter of one key returns the bare value: values_at must not)
    assert values_at({5: (1, 2)}, (5,)) == ((1, 2),)
    assert values_at({}, ()) == ()
    assert all_in({}, ())
    assert not all_in({}, (1,))
