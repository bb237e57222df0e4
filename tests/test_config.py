import dataclasses
import math

import pytest

from nmtcore.config import (
    PRESETS,
    ConfigError,
    ExperimentConfig,
    TrainConfig,
    parse_overrides,
    preset,
)


def test_presets_build_and_carry_the_papers_settings():
    iwslt = preset("transformer_iwslt_de_en")
    assert (iwslt.model.encoder_layers, iwslt.model.decoder_layers, iwslt.model.d_model) == (6, 6, 512)
    assert (iwslt.model.ffn_dim, iwslt.model.heads, iwslt.model.dropout) == (1024, 4, 0.3)
    small = preset("multi30k_small")
    assert (small.model.encoder_layers, small.model.d_model, small.model.ffn_dim, small.model.heads) == (3, 256, 1024, 4)
    assert small.data.vocab_size == 8000 and small.data.corpus == "multi30k"
    assert set(PRESETS) == {"transformer_iwslt_de_en", "multi30k_small", "plm_sponsored_iwslt_paper",
                            "plm_sponsored_ablation_paper"}
    # The PLM-sponsored presets' paper settings: tests/test_plm_sponsored.py.


@pytest.mark.parametrize("d, key", [
    ({"train": {"lrr": 1}}, "train.lrr: unknown key"),
    ({"modle": {}}, "modle: unknown key"),
    ({"model": {"name": "transformer", "dropuot": 0.1}}, "model.dropuot: unknown key"),
])
def test_unknown_nested_keys_raise_naming_the_key(d, key):
    with pytest.raises(ConfigError) as e:
        ExperimentConfig.from_dict(d)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, key", [
    ({"model.dropout": 1.5}, "model.dropout"),
    ({"model.heads": 3}, "model.heads"),
    ({"train.lr": -1}, "train.lr"),
    ({"train.lr": "abc"}, "train.lr"),
    ({"train.label_smoothing": 1.0}, "train.label_smoothing"),
    ({"data.max_tokens": 0}, "data.max_tokens"),
    ({"data.prefetch_batches": -1}, "data.prefetch_batches"),
    ({"decode.nbest": 9}, "decode.nbest"),
    ({"decode.max_sentences": -1}, "decode.max_sentences"),
    ({"train.precision": "fp8"}, "train.precision"),
    ({"data.tgt_lang": "en"}, "data.tgt_lang"),
    ({"train.max_epochs": 2.5}, "train.max_epochs"),
    ({"train.phase_scale": 0}, "train.phase_scale"),
    ({"train.phases": [{"name": "a", "epochs": 8}, {"name": "b", "epochs": 4}]}, "train.max_epochs"),  # 12 > 10
    ({"train.lr_typo": 1}, "train.lr_typo"),
    ({"model.name": "no_such_model"}, "model.name"),
])
def test_out_of_range_and_mistyped_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as e:
        preset("multi30k_small").with_overrides(override)
    assert str(e.value).split(":")[0] == key, str(e.value)


def test_decode_batch_size_by_device_unless_set():
    import torch

    auto = preset("multi30k_small").decode
    assert auto.max_sentences == 0
    assert auto.sentences_per_batch(torch.device("cpu")) == 128
    assert auto.sentences_per_batch(torch.device("cuda", 0)) == 1024
    fixed = dataclasses.replace(auto, max_sentences=50)
    assert {fixed.sentences_per_batch(torch.device(d)) for d in ("cpu", "cuda")} == {50}


def test_heads_must_divide_d_model_message():
    with pytest.raises(ConfigError, match=r"model.heads: must divide model.d_model \(256 % 3 != 0\)"):
        preset("multi30k_small").with_overrides({"model.heads": 3})


def test_dotted_string_overrides_are_parsed_against_field_types():
    cfg = preset("multi30k_small").with_overrides(parse_overrides(
        ["train.lr=1e-3", "model.pre_norm=true", "data.test_splits=test_2016_flickr,test_2017_flickr",
         "train.adam_betas=[0.9, 0.997]", "decode.beam=4"]))
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.pre_norm is True
    assert cfg.data.test_splits == ("test_2016_flickr", "test_2017_flickr")
    assert cfg.train.adam_betas == (0.9, 0.997)
    assert cfg.decode.beam == 4


def test_yaml_round_trip_and_flat_view(tmp_path):
    cfg = preset("multi30k_small").with_overrides({"train.seed": 7})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert ExperimentConfig.from_yaml(path) == cfg
    flat = cfg.flat()
    assert flat["train.seed"] == 7 and flat["model.d_model"] == 256 and "data.vocab_size" in flat


def test_configs_are_frozen():
    cfg = preset("multi30k_small")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["train.lr"])
    with pytest.raises(ConfigError, match="train.lr.x: unknown key"):
        preset("multi30k_small").with_overrides({"train.lr.x": 1})


def test_switching_model_family_keeps_shared_dims_and_bert():
    from nmtcore.config import MODEL_CONFIGS

    other = next((n for n in MODEL_CONFIGS if n != "transformer"), None)
    if other is None:
        pytest.skip("only the transformer is registered")
    cfg = preset("multi30k_small").with_overrides({"model.bert.name": "minilm"}).with_overrides(
        {"model.name": other})
    assert cfg.model.name == other and type(cfg.model) is MODEL_CONFIGS[other]
    assert (cfg.model.d_model, cfg.model.encoder_layers, cfg.model.ffn_dim) == (256, 3, 1024)
    assert cfg.model.bert.name == "minilm"


def test_switching_model_family_and_setting_its_own_fields_in_one_call():
    # `--set model.name=bert_jam model.phase_epochs=[1,1,1]`: the new family's fields exist in the same call.
    cfg = preset("multi30k_small").with_overrides(parse_overrides(
        ["model.name=bert_jam", "model.bert.name=minilm", "model.phase_epochs=[1,1,1]", "model.d_model=128"]))
    assert (cfg.model.name, cfg.model.phase_epochs, cfg.model.d_model) == ("bert_jam", (1, 1, 1), 128)
    fused = preset("multi30k_small").with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm",
                                                    "model.p_net": 0.0})
    assert fused.model.p_net == 0.0 and fused.model.ffn_dim == 1024
    with pytest.raises(ConfigError, match="model.phase_epochs: unknown key"):  # the transformer has no phases
        preset("multi30k_small").with_overrides({"model.phase_epochs": [1, 1, 1]})


def test_switching_family_keeps_set_fields_and_takes_the_new_familys_defaults():
    # The preset sets d_model; the baseline leaves its BERT unset, so plm_sponsored's own default
    # source/target BERTs apply (a carried-over "no BERT" would make the family unusable).
    plm = preset("multi30k_small").with_overrides({"model.name": "plm_sponsored"})
    assert plm.model.d_model == 256 and plm.model.bert.name == "minilm" and plm.model.tgt_bert.name
    # A BERT the user chose survives the switch, and so does a changed dropout.
    fused = preset("multi30k_small").with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm",
                                                    "model.dropout": 0.3})
    back = fused.with_overrides({"model.name": "plm_sponsored"})
    # Per key inside the BERT section: the chosen name stays, the unset freeze takes plm's (fine-tuned).
    assert (back.model.bert.name, back.model.dropout, back.model.bert.freeze) == ("minilm", 0.3, False)


@pytest.mark.parametrize("text, message", [
    ("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "line 3, column 3: key 'lr' given twice (the second would silently win)"),
    ("train:\n  lr: 1.0e-3\ntrain:\n  max_epochs: 2\n", "line 3, column 1: key 'train' given twice"),
    ("", "empty (no data/model/train/decode sections)"),
    ("# nothing but a comment\n", "empty (no data/model/train/decode sections)"),
    ("- train\n- model\n", "top level must be a mapping"),
])
def test_a_config_file_that_does_not_say_one_thing_is_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "exp.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        ExperimentConfig.from_yaml(path)
    assert str(e.value) == f"{path}: {message}" or str(e.value).startswith(f"{path}: {message}")
    assert "\n" not in str(e.value)


def test_a_config_path_naming_a_directory_or_nothing_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        ExperimentConfig.from_yaml(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        ExperimentConfig.from_yaml(tmp_path / "absent.yaml")


@pytest.mark.parametrize("key", ["lr", "warmup_init_lr", "adam_eps", "weight_decay", "label_smoothing", "clip_norm"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_training_number_is_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=f"train.{key}: must be a finite number"):
        TrainConfig(**{key: value})
