"""The family registry: every family registered, configs that refuse what their model ignores, old
config.json files that still load, and no family branches outside the family modules."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from blockloop.config import DecoderConfig, field_defaults
from blockloop.errors import ConfigError
from blockloop.families import FAMILIES, PRESETS, build_model, config_from_dict, from_name, spec_of
from blockloop.families.double_decoder import DoubleDecoderConfig
from blockloop.families.staircase import StaircaseConfig

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"local_layers": [0], "sliding_window": 4, "local_rope_base": 1e4, "learned_positions": True, "embed_scale": True}


def test_every_family_is_registered_with_its_config_model_and_presets():
    assert set(FAMILIES) == {"decoder", "double_decoder", "encoder_decoder", "block", "recursive", "staircase", "ladder"}
    for name, spec in FAMILIES.items():
        assert spec.name == name and spec.config_class.family == name and spec.presets
        for preset in spec.presets:
            config = from_name(preset.name)
            assert type(config) is spec.config_class and config.name == preset.name and spec_of(config) is spec
    assert len(PRESETS) == sum(len(spec.presets) for spec in FAMILIES.values())


@pytest.mark.parametrize("field, value", LOCAL.items())
def test_staircase_refuses_local_attention_fields_everywhere(field, value):
    """Its core's windows and its stream's embedding are its own: a sliding window or a learned position table
    would silently do nothing, so they are refused by name."""
    with pytest.raises(TypeError, match=field):
        StaircaseConfig(**{field: value})
    data = from_name("tiny-staircase").to_dict()
    with pytest.raises(ConfigError, match=rf"staircase config has no config field {field}"):
        config_from_dict({**data, field: value})
    with pytest.raises(ConfigError, match=rf"staircase config has no config field {field}"):
        from_name("tiny-staircase", **{field: value})
    with pytest.raises(ConfigError, match=rf"staircase config has no config field {field}"):
        from_name("tiny-staircase").replace(**{field: value})


def test_staircase_keeps_attn_scalar_and_the_decoder_keeps_local_attention():
    assert from_name("tiny-staircase", attn_scalar=32.0).attn_scale == 32.0**-0.5
    assert from_name("tiny", local_layers=[0], sliding_window=4).local_layers == [0]


@pytest.mark.parametrize("name", ["tiny-staircase", "tiny-ladder", "tiny-double", "tiny-encdec"])
def test_an_old_format_config_json_still_loads_and_round_trips(name):
    """Before the families dropped field groups, to_dict wrote every DecoderConfig field: those at their
    defaults are read as absent, anything else is refused. Every config also held an ``extra`` dict no model read."""
    config = from_name(name)
    assert "extra" not in config.to_dict()
    old = {**config.to_dict(), "sliding_window": None, "local_layers": [], "local_rope_base": None, "extra": {}}
    assert old["family"] == config.family
    loaded = config_from_dict(old)
    assert loaded == config and config_from_dict(loaded.to_dict()) == config
    with pytest.raises(ConfigError, match="local_layers"):
        config_from_dict({**old, "local_layers": [1], "sliding_window": 4})


def test_a_decoder_config_json_without_family_is_a_decoder():
    data = DecoderConfig(n_layer=2, d_model=64, n_head=4).to_dict()
    del data["family"]
    assert type(config_from_dict(data)) is DecoderConfig


def test_stack_is_the_plain_transformer_of_the_same_shape():
    config = from_name("tiny-staircase", attn_scalar=16.0)
    core = config.stack()
    assert type(core) is DecoderConfig and core.n_layer == config.n_layer and core.attn_scalar == 16.0
    assert not core.local_layers and config.stack(1).n_layer == 1
    shared = {f.name for f in dataclasses.fields(DecoderConfig)} & {f.name for f in dataclasses.fields(config)}
    assert all(getattr(core, k) == getattr(config, k) for k in shared - {"n_layer"})


def test_no_family_branches_outside_the_family_modules():
    """Everything outside blockloop.families asks the spec (or the serving runner), never the family's name."""
    branch = re.compile(r"family (==|!=|in \()")
    families = ROOT / "src" / "blockloop" / "families"
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "src").rglob("*.py")) if families not in path.parents
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if branch.search(line)]
    assert found == []
    assert branch.search('if config.family == "block":') and branch.search("elif c.family in (")  # it finds them


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {"d_model": 128}),
    ("tiny", {"n_head": 8, "n_kv_head": 8}),
    ("tiny", {"mlp": "gelu"}),
    ("tiny", {"vocab_size": 1000}),
    ("tiny-recursive", {"d_model": 128, "vocab_size": 100}),
    ("tiny-block", {"block_d_model": 128, "token_d_model": 128}),
    ("tiny-encdec", {"vocab_size": 400}),
])
def test_overriding_a_preset_derives_its_sizes_again(preset, overrides):
    """head_dim, d_ff, n_kv_head, padded_vocab_size and embed_dim that a preset left to be derived follow the
    override, as `--set d_model=128` means: the config equals one built with those fields from the start."""
    fields = {**PRESETS[preset].fields, "name": preset, **overrides}
    fresh = spec_of(from_name(preset)).config_class(**fields)
    assert from_name(preset, **overrides) == fresh
    assert from_name(preset).replace(**overrides) == fresh
    if "d_model" in overrides:
        assert fresh.head_dim * fresh.n_head == 128


def test_a_derived_size_given_explicitly_is_kept_by_replace():
    config = from_name("tiny", head_dim=32)
    assert config.replace(n_layer=3).head_dim == 32
    assert config.replace(d_model=128).d_ff == from_name("tiny", d_model=128).d_ff  # d_ff was derived


@pytest.mark.parametrize("preset", ["staircase-reddit", "cached-staircase-enwik8", "ladder-base"])
def test_staircase_language_models_drop_embeddings_as_table_5_says(preset):
    """Table 5: dropout 0.3 in the layers, 0.2 on the embeddings; a config without its own embedding rate follows
    ``dropout``, also when replace() changes it."""
    config = from_name(preset)
    assert (config.dropout, config.embed_dropout) == (0.3, 0.2)
    assert config.replace(dropout=0.1).embed_dropout == 0.2  # set by the preset: kept
    model = build_model(from_name(preset, n_layer=1, d_model=64, n_head=2, vocab_size=64))
    assert model.drop.p == 0.2 and {m.dropout for m in model.modules() if hasattr(m, "post_mlp_norm")} == {0.3}
    assert from_name("tiny").replace(dropout=0.1).embed_dropout == 0.1  # derived: follows dropout
    with pytest.raises(ConfigError, match=r"embed_dropout must be in \[0, 1\), got 1.5"):
        from_name("tiny", embed_dropout=1.5)


@pytest.mark.parametrize("fields, says", [
    ({"embedder": "encoder", "embed_dim": 16, "embedder_n_head": 0}, "embedder_n_head=0 does not divide embed_dim=16"),
    ({"embedder": "encoder", "embed_dim": 16, "embedder_n_head": 3}, "embedder_n_head=3 does not divide embed_dim=16"),
    ({"embedder": "cls", "embed_dim": 16, "embedder_n_layer": 0}, "the cls embedder needs embedder_n_layer >= 1"),
])
def test_block_embedder_shapes_are_checked_not_replaced(fields, says):
    """The encoder embedder used to fall back to one head, or one layer, without a word."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        from_name("tiny-block", **fields)


def test_a_local_layer_named_twice_is_refused():
    with pytest.raises(ConfigError, match=re.escape("local_layers=[1, 1] names a layer twice")):
        DecoderConfig(n_layer=2, n_head=4, d_model=64, local_layers=[1, 1], sliding_window=4)


def test_the_library_entry_points_refuse_a_wrong_kind_of_argument_in_one_line():
    """From Python as from the command line: a wrong kind of argument is a ConfigError naming it, not a TypeError
    from deep inside (difflib on a None name, dict() of a list, a block model's window cut mid-block)."""
    import torch

    from blockloop.families import build_model

    with pytest.raises(ConfigError, match="a preset name is a string, got None"):
        from_name(None)
    with pytest.raises(ConfigError, match="a config is a mapping .* got list"):
        config_from_dict([1, 2])
    block = build_model(from_name("tiny-block"))
    with pytest.raises(ConfigError, match="sequence length 6 is not a multiple of block_len=4; pad or cut"):
        block(torch.zeros(1, 6, dtype=torch.long))


def test_library_misuse_of_the_builders_is_named():
    from blockloop.convert.to_block import vanilla_to_block
    from blockloop.errors import BlockloopError

    with pytest.raises(BlockloopError, match=r"build_model takes a config, not a name; build_model\(from_name\('tiny'\)\)"):
        build_model("tiny")
    with pytest.raises(BlockloopError, match=r"--block-len \(block_len\) of a Block Transformer must be at least 1"):
        vanilla_to_block(build_model(from_name("tiny")), block_len=0)  # a ZeroDivisionError before
    config = from_name("tiny")
    config.vocab_size = 1000  # set by hand: its padded vocabulary stayed 258, and the model was built with it
    with pytest.raises(BlockloopError, match="padded_vocab_size=258 is smaller than vocab_size=1000"):
        build_model(config)



def test_summaries_name_what_a_preset_repeats():
    """The Ladder's summary names its steps and their order; one step (Transformer-XL) has no order to name."""
    assert from_name("tiny-ladder-aabb").summary() == "ladder: core 2 layers x 2 steps (AABB), d=64"
    assert from_name("tiny-transformer-xl").summary() == "one step: core 2 layers, d=64, memory 16"
    assert from_name("tiny-universal").summary() == "ladder: core 1 layer x 4 steps (ABAB), d=64"


UNREAD = [  # (preset, the fields asked for, the one no part of the model would read, what makes it read)
    ("tiny", {"sliding_window": 4}, "sliding_window", {"local_layers": [1]}),  # every layer global: no window
    ("tiny", {"local_rope_base": 500.0}, "local_rope_base", {"local_layers": [1], "sliding_window": 4}),
    ("tiny-recursive", {"sliding_window": 4}, "sliding_window", {"local_depths": [0]}),  # local by depth
    ("tiny-block", {"embedder_n_layer": 2}, "embedder_n_layer", {"embedder": "encoder"}),  # lookup: no transformer
    ("tiny-block", {"n_cls": 4}, "n_cls", {"embedder": "cls"}),
    ("tiny-block", {"prefix_len": 3, "token_decoder": "sum"}, "prefix_len", {"token_decoder": "prefix"}),
    ("tiny-double", {"partition_lengths": [3, 5]}, "partition_lengths", {"partition": "histogram"}),
    ("tiny-double", {"partition": "histogram", "partition_lengths": [3], "max_blocks": 4}, "max_blocks",
     {"partition": "uniform", "partition_lengths": []}),
]


@pytest.mark.parametrize("preset, asked, field, reading", UNREAD)
def test_a_field_no_part_of_the_model_reads_is_refused_and_old_configs_load_without_it(preset, asked, field, reading):
    """``--set sliding_window=4`` on a model with no local layers changed nothing, silently: a field the model would
    not read is refused by name, accepted once another field makes it read, and a config.json written before the
    refusal loads as the model it was (the field is dropped: nothing read it)."""
    with pytest.raises(ConfigError, match=rf"{field}=.* so it would change nothing; leave it out"):
        from_name(preset, **asked)
    assert getattr(from_name(preset, **{**asked, **reading}), field) == asked[field]
    rest = {name: value for name, value in asked.items() if name != field}
    assert config_from_dict({**from_name(preset, **rest).to_dict(), field: asked[field]}) == from_name(preset, **rest)


def test_a_preset_field_that_a_change_leaves_unread_takes_its_default():
    """tiny-double sets max_blocks=8 for its uniform partitions: asking for partition='histogram' (of the preset, or
    of a config by replace, as --set on a run does) drops it rather than refusing what was not asked for."""
    asked = {"partition": "histogram", "partition_lengths": [3, 5]}
    histogram = from_name("tiny-double", **asked)
    assert from_name("tiny-double").max_blocks == 8 and histogram.max_blocks == field_defaults(DoubleDecoderConfig)["max_blocks"]
    assert from_name("tiny-double").replace(**asked) == histogram


def test_an_empty_model_name_is_refused_without_an_empty_prefix():
    with pytest.raises(ConfigError, match="^name is empty; give the model a name"):  # every other check starts "NAME: "
        from_name("tiny", name=" ")
