import pytest

from attnbench.shapes import get_shape, load_shapes, parse_shapes, shape_names

ISSUE_PRESETS = {
    # name: (heads_q, heads_kv, head_dim, head_dim_v)
    "llama3-8b": (32, 8, 128, 128),
    "llama3-70b": (64, 8, 128, 128),
    "deepseek-v2-lite": (16, 16, 192, 128),
    "diff-transformer-3b": (12, 12, 128, 256),
    "vit-s16": (6, 6, 64, 64),
    "retnet-6.7b": (32, 32, 256, 512),
    "mamba2-2.7b": (80, 80, 64, 64),
    "yoco-13b": (40, 40, 256, 256),
}


@pytest.mark.parametrize("name", sorted(ISSUE_PRESETS))
def test_issue_presets(name):
    s = get_shape(name)
    assert (s.heads_q, s.heads_kv, s.head_dim, s.head_dim_v) == ISSUE_PRESETS[name]


def test_every_preset_names_its_source():
    shapes = load_shapes()
    assert set(ISSUE_PRESETS) <= set(shapes)
    for s in shapes.values():
        assert len(s.source) > 10, s.name
    assert get_shape("mamba2-2.7b").state_dim == 128
    assert get_shape("llama3-8b").gqa and not get_shape("vit-s16").gqa


def test_unknown_shape_lists_known():
    with pytest.raises(ValueError, match="unknown shape 'llama9'.*llama3-8b"):
        get_shape("llama9")
    assert "llama3-70b" in shape_names()


@pytest.mark.parametrize("entry, msg", [
    ({"heads_q": 6, "heads_kv": 4, "head_dim": 64, "source": "x"}, "multiple of heads_kv"),
    ({"heads_q": 6, "head_dim": 0, "source": "x"}, "head_dim must be a positive"),
    ({"heads_q": 6, "head_dim": 64}, "missing required key 'source'"),
    ({"heads_q": 6, "head_dim": 64, "source": "x", "heads": 3}, "unknown keys"),
])
def test_bad_presets_rejected(entry, msg):
    with pytest.raises(ValueError, match=msg):
        parse_shapes({"bad": entry})
