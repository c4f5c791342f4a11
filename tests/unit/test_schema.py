from __future__ import annotations

from recpipe import schema


def test_contract_sizes() -> None:
    assert (schema.USERS.rows, schema.ITEMS.rows, schema.INTERACTIONS.rows) == (221_000, 850_000, 4_000_000)
    assert [c.name for c in schema.USERS.continuous] == [f"u_cont_{i:02d}" for i in range(40)]
    assert [c.name for c in schema.USERS.categorical] == [f"u_cat_{i:02d}" for i in range(44)]
    assert [c.name for c in schema.ITEMS.continuous] == [f"i_cont_{i:02d}" for i in range(20)]
    assert [c.name for c in schema.ITEMS.categorical] == [f"i_cat_{i:02d}" for i in range(16)]


def test_rows_scale_linearly_rounded_at_least_one() -> None:
    assert schema.USERS.rows_at(0.01) == 2210
    assert schema.INTERACTIONS.rows_at(10) == 40_000_000
    assert schema.ITEMS.rows_at(1e-9) == 1


def test_cardinalities_span_handful_to_hundreds_of_thousands() -> None:
    cards = [c.cardinality for c in schema.ITEMS.categorical + schema.USERS.categorical]
    assert min(cards) <= 3 and max(cards) >= 500_000
    brand = schema.ITEMS.column("i_cat_02")
    assert brand.cardinality_at(0.01) == 2000 and brand.cardinality_at(1) == 200_000
