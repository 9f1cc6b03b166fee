from dataclasses import dataclass

import pytest
from kernel_common import ConfigTable, KeyField, heads_bucket, next_pow2


@dataclass(frozen=True)
class Cfg:
    block: int = 64
    backend: str = "torch"


@dataclass
class Mutable:
    block: int = 64


FIELDS = [KeyField("arch_major"), KeyField("heads", heads_bucket)]


def table(rows=None):
    rows = (
        rows
        if rows is not None
        else [
            ({"arch_major": 9, "heads": 64}, Cfg(128), "measured H200"),
            ({"arch_major": 9, "heads": 8}, Cfg(32)),
        ]
    )
    return ConfigTable("t", Cfg, FIELDS, rows, default=Cfg())


def test_buckets():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
    assert [heads_bucket(h) for h in (1, 5, 8, 9, 16, 32, 33, 64, 128)] == [
        8,
        8,
        8,
        16,
        16,
        32,
        64,
        64,
        64,
    ]


def test_lookup_sources():
    t = table()
    hit = t.lookup(arch_major=9, heads=40)
    assert hit.config == Cfg(128) and hit.source == "row (measured H200)"
    assert hit.key == (("arch_major", 9), ("heads", 64))
    assert t.lookup(arch_major=9, heads=3).config == Cfg(32)
    miss = t.lookup(arch_major=10, heads=64)
    assert miss.config == Cfg() and miss.source == "default"
    mine = Cfg(16, "x")
    assert t.lookup(mine, arch_major=9, heads=64).config is mine
    assert t.lookup(mine, arch_major=9, heads=64).source == "caller"


def test_validation():
    with pytest.raises(TypeError, match="frozen dataclass"):
        ConfigTable("t", Mutable, FIELDS, [], default=Mutable())
    with pytest.raises(TypeError, match="must be a Cfg"):
        table([({"arch_major": 9, "heads": 8}, Mutable())])
    with pytest.raises(ValueError, match="unknown \\['tail'\\]"):
        table([({"arch_major": 9, "heads": 8, "tail": True}, Cfg())])
    with pytest.raises(ValueError, match="missing \\['heads'\\]"):
        table([({"arch_major": 9}, Cfg())])
    with pytest.raises(ValueError, match="duplicate row"):
        table([({"arch_major": 9, "heads": 5}, Cfg()), ({"arch_major": 9, "heads": 8}, Cfg(1))])
    with pytest.raises(ValueError, match="duplicate key field"):
        ConfigTable("t", Cfg, [KeyField("a"), KeyField("a")], [], default=Cfg())
    with pytest.raises(TypeError, match="caller's config"):
        table().lookup(Mutable(), arch_major=9, heads=8)
    with pytest.raises(ValueError, match="missing"):
        table().lookup(arch_major=9)


def test_enumeration_and_json_round_trip():
    t = table()
    assert [r.config for r in t.rows()] == [Cfg(128), Cfg(32)]
    assert t.configs() == [Cfg(128), Cfg(32), Cfg()]
    back = t.from_json(t.to_json())
    assert [(r.key, r.config, r.note) for r in back.rows()] == [
        (r.key, r.config, r.note) for r in t.rows()
    ]
    assert back.default == t.default
    assert back.lookup(arch_major=9, heads=64).config == Cfg(128)
    with pytest.raises(ValueError, match="fields"):
        ConfigTable("u", Cfg, [KeyField("x")], [], Cfg()).from_json(t.to_json())
    bad = t.to_json().replace('"block"', '"blok"')
    with pytest.raises(ValueError, match="bad config"):
        t.from_json(bad)


def test_config_schema_and_fields():
    """Config dataclasses cross custom ops as their fields: schema text in declaration order,
    values in the same order; a field a custom op cannot take is refused."""
    from kernel_common.config import config_fields, config_schema

    @dataclass(frozen=True)
    class Op:
        backend: str = "triton"
        block: int = 64
        rotate: bool = False
        scale: float = 0.5

    assert config_schema(Op) == "str backend, int block, bool rotate, float scale"
    assert config_fields(Op(block=32)) == ("triton", 32, False, 0.5)
    assert Op(*config_fields(Op(block=32))) == Op(block=32)

    @dataclass(frozen=True)
    class Bad:
        sizes: tuple = (1, 2)

    with pytest.raises(TypeError, match=r"Bad\.sizes: a custom op cannot take tuple"):
        config_schema(Bad)
