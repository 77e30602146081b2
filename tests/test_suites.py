from pathlib import Path

import pytest

from attnbench.impls import IMPL_NAMES
from attnbench.suites import SUITES_DIR, SuiteError, load_suite, match, parse_suite

# the engine's variant names (engine_contract.md)
VARIANT_NAMES = ["softmax", "softmax_causal", "softmax_gqa", "sigmoid", "relu", "alibi", "softcap",
                 "sliding_window", "document", "prefix_lm", "retnet", "mistral_window", "gemma2"]
SHIPPED = ["smoke", "llama3", "paper", "variants", "linear", "decode", "reach", "models"]


def base(**over):
    data = {"impls": ["reference", "sdpa-math"], "modes": ["fwd"], "dtypes": ["float32"],
            "cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"], "seqlens": [128]}]}
    data.update(over)
    return data


def parse(data, **kw):
    return parse_suite(data, name="t", variant_names=VARIANT_NAMES, **kw)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_suites_parse(name):
    suite = load_suite(name)  # the engine's whole libraries, per kind, as at run time
    assert suite.cases and suite.repeats >= 30
    names = [c.name for c in suite.cases]
    assert len(names) == len(set(names))
    for c in suite.cases:
        assert c.baseline in c.impls and set(c.impls) <= set(IMPL_NAMES)


def test_paper_grid_is_16k_tokens_and_hidden_2048():
    suite = load_suite("paper", variant_names=VARIANT_NAMES)
    assert {c.head_dim for c in suite.cases} == {64, 128, 256}
    for c in suite.cases:
        assert c.batch * c.seqlen_q == 16384 and c.heads_q * c.head_dim == 2048


def test_llama3_covers_both_models_1k_to_16k():
    suite = load_suite("llama3", variant_names=VARIANT_NAMES)
    assert {c.shape for c in suite.cases} == {"llama3-8b", "llama3-70b"}
    assert {c.seqlen_q for c in suite.cases} == {1024, 2048, 4096, 8192, 16384}


def test_expansion_and_names():
    s = parse(base(dtypes=["fp16", "bf16"], cases=[{
        "variants": ["softmax", "softmax_causal"], "shapes": ["llama3-8b"],
        "seqlens": [128, 256], "batch": [1, 2]}]))
    assert len(s.cases) == 2 * 2 * 2 * 2
    c = s.cases[0]
    assert c.name == "softmax/llama3-8b/b1/s128/float16"
    assert (c.heads_q, c.heads_kv, c.head_dim) == (32, 8, 128)
    assert c.baseline == "reference" and c.modes == ("fwd",)


def test_tokens_sets_batch_and_block_overrides_default():
    s = parse(base(tokens=1024, cases=[
        {"variants": ["softmax"], "shapes": ["vit-s16"], "seqlens": [256, 512]},
        {"variants": ["softmax"], "shapes": ["vit-s16"], "seqlens": [128], "batch": 3}]))
    assert [(c.batch, c.seqlen_q) for c in s.cases] == [(4, 256), (2, 512), (3, 128)]


def test_separate_seqlens_for_decode():
    s = parse(base(kind="decode", cases=[{"variants": ["softmax"], "shapes": ["llama3-8b"],
                                          "seqlen_q": [1], "seqlen_kv": [4096, 8192]}]))
    assert [(c.seqlen_q, c.seqlen_kv, c.kind) for c in s.cases] == [(1, 4096, "decode"),
                                                                      (1, 8192, "decode")]
    assert s.cases[0].name.endswith("s1x4096/float32")


@pytest.mark.parametrize("bad, msg", [
    ({"cases": [{"variants": ["softmaxx"], "shapes": ["llama3-8b"], "seqlens": [1]}]},
     r"unknown variant 'softmaxx'; known attention variants: .*softmax_causal"),
    ({"impls": ["reference", "fa9"]}, r"unknown implementation 'fa9'; known .*sdpa-cudnn"),
    ({"cases": [{"variants": ["softmax"], "shapes": ["llama9"], "seqlens": [1]}]},
     r"unknown shape 'llama9'; known shapes: .*llama3-70b"),
    ({"modes": ["forward"]}, r"unknown mode 'forward'"),
    ({"dtypes": ["int8"]}, r"unknown dtype 'int8'"),
    ({"baseline": "flex"}, r"baseline 'flex' is not one of its impls"),
    ({"kind": "sparse"}, r"unknown kind 'sparse'"),
    ({"repeats": 0}, r"repeats must be an integer >= 1"),
    ({"cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"]}]}, r"missing 'seqlens'"),
    ({"cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"], "seqlens": [0]}]},
     r"seqlen_q must be a positive integer"),
    ({"cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"], "seqlens": [1],
                 "colour": "red"}]}, r"unknown keys \['colour'\]"),
    ({"cases": []}, r"'cases' must be a non-empty list"),
])
def test_validation_errors(bad, msg):
    with pytest.raises(SuiteError, match=msg):
        parse(base(**bad))


def test_all_problems_reported_at_once():
    with pytest.raises(SuiteError) as info:
        parse(base(impls=["nope"], modes=["sideways"]))
    assert "nope" in str(info.value) and "sideways" in str(info.value)


def test_shape_override_and_unknown_override():
    s = parse(base(cases=[{"variants": ["softmax"], "shapes": ["llama3-8b", "llama3-70b"],
                           "seqlens": [64]}]), shape_override="vit-s16")
    assert [c.shape for c in s.cases] == ["vit-s16"] and s.cases[0].heads_q == 6
    with pytest.raises(SuiteError, match="unknown shape 'nope' \\(--shape\\)"):
        parse(base(), shape_override="nope")


def test_filter_substring_and_glob():
    s = parse(base(cases=[{"variants": ["softmax", "softmax_causal"], "shapes": ["llama3-8b"],
                           "seqlens": [128, 256]}]))
    assert len(s.filtered(["causal"]).cases) == 2
    assert len(s.filtered(["softmax/*/s256/*"]).cases) == 1
    assert len(s.filtered(["s128", "s256"]).cases) == 4
    assert match("a/b/c", "a*c") and not match("a/b/c", "x")


def test_unknown_suite_lists_known(tmp_path: Path):
    with pytest.raises(SuiteError, match="known suites: .*smoke"):
        load_suite("nosuch", variant_names=VARIANT_NAMES)
    assert (SUITES_DIR / "smoke.toml").is_file()
    f = tmp_path / "mine.toml"
    f.write_text('impls = ["reference"]\nmodes = ["fwd"]\ndtypes = ["float32"]\n'
                 '[[cases]]\nvariants = "softmax"\nshapes = "vit-s16"\nseqlens = 64\n')
    s = load_suite(str(f), variant_names=VARIANT_NAMES)
    assert s.name == "mine" and s.cases[0].name == "softmax/vit-s16/b1/s64/float32"


def test_yaml_suite(tmp_path: Path):
    pytest.importorskip("yaml")
    f = tmp_path / "y.yaml"
    f.write_text("impls: [reference]\nmodes: [fwd]\ndtypes: [float32]\n"
                 "cases:\n  - {variants: [softmax], shapes: [vit-s16], seqlens: [64]}\n")
    assert len(load_suite(str(f), variant_names=VARIANT_NAMES).cases) == 1
