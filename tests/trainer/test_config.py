import pytest
from pydantic import ValidationError

from sftjob_contract.config import ConfigError, SFTConfig, build_config, load_config, parse_overrides

pytestmark = pytest.mark.unit

MINIMAL = {"model": {"path": "m"}, "data": {"train_files": "d.parquet"}, "trainer": {"output_dir": "o"}}


def test_defaults_and_string_file_list():
    cfg = build_config(MINIMAL)
    assert cfg.data.train_files == ["d.parquet"]
    assert cfg.lora.rank == 0 and cfg.optim.lr_scheduler == "cosine" and cfg.data.truncation == "error"


def test_overrides_parse_types_and_nest():
    tree = parse_overrides(["optim.lr=1e-5", "data.packing=true", "data.train_files=[a.parquet,b.parquet]",
                            "lora.rank=8"])
    assert tree == {"optim": {"lr": "1e-5"}, "data": {"packing": True, "train_files": ["a.parquet", "b.parquet"]},
                    "lora": {"rank": 8}}
    cfg = build_config({**MINIMAL, "optim": tree["optim"]})
    assert cfg.optim.lr == pytest.approx(1e-5)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"optim\.learning_rate: unknown key"):
        build_config({**MINIMAL, "optim": {"learning_rate": 1.0}})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match=r"trainr: unknown key"):
        build_config({**MINIMAL, "trainr": {}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size: .*integer"):
        build_config({**MINIMAL, "data": {"train_files": "x", "train_batch_size": "many"}})


def test_missing_required_is_named():
    with pytest.raises(ConfigError, match=r"model: required key is missing"):
        build_config({k: v for k, v in MINIMAL.items() if k != "model"})


def test_micro_batch_must_divide_global():
    with pytest.raises(ConfigError, match=r"micro_batch_size_per_gpu \(3\) must divide data.train_batch_size \(8\)"):
        build_config({**MINIMAL, "data": {"train_files": "x", "train_batch_size": 8, "micro_batch_size_per_gpu": 3}})


def test_bad_enum_is_named():
    with pytest.raises(ConfigError, match=r"optim\.lr_scheduler"):
        build_config({**MINIMAL, "optim": {"lr_scheduler": "linear"}})


def test_yaml_file_plus_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\ndata: {train_files: [a.parquet]}\ntrainer: {output_dir: o, seed: 1}\n")
    cfg = load_config(f, ["trainer.seed=7"])
    assert cfg.trainer.seed == 7 and cfg.data.train_files == ["a.parquet"]


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["optim.lr"])


def test_config_is_frozen():
    cfg = build_config(MINIMAL)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.trainer.seed = 3  # type: ignore[misc]


def test_schema_has_descriptions_everywhere():
    schema = SFTConfig.model_json_schema()
    for name, section in schema["$defs"].items():
        for field, prop in section["properties"].items():
            assert prop.get("description"), f"{name}.{field} has no description"


@pytest.mark.parametrize("section, values, field", [
    ("optim", {"betas": [1.0, 0.95]}, r"optim\.betas\.0"),
    ("optim", {"betas": [0.9, -0.5]}, r"optim\.betas\.1"),
    ("trainer", {"output_dir": "o", "seed": -1}, r"trainer\.seed"),
    ("data", {"train_files": "x", "prompt_key": "text", "response_key": "text"}, r"prompt_key and data\.response_key"),
])
def test_values_that_would_fail_later_are_refused_naming_the_field(section, values, field):
    with pytest.raises(ConfigError, match=field):
        build_config({**MINIMAL, section: values})


def test_same_prompt_and_response_column_is_fine_for_chat_data():
    cfg = build_config({**MINIMAL, "data": {"train_files": "x", "messages_key": "messages",
                                            "prompt_key": "m", "response_key": "m"}})
    assert cfg.data.messages_key == "messages"


def test_time_based_checkpoint_default_and_bounds():
    assert build_config(MINIMAL).trainer.save_interval_s == 1800.0
    assert build_config({**MINIMAL, "trainer": {"output_dir": "o", "save_interval_s": 0}}).trainer.save_interval_s == 0
    with pytest.raises(ConfigError, match=r"trainer\.save_interval_s"):
        build_config({**MINIMAL, "trainer": {"output_dir": "o", "save_interval_s": -1}})


def test_a_local_model_path_that_is_not_there_is_named(tmp_path):
    """transformers reads a missing directory as a malformed hub repo id; the trainer says what it is."""
    from sftjob_trainer.errors import InvalidConfig
    from sftjob_trainer.modelcache import local_model_path

    missing = tmp_path / "no-model"
    with pytest.raises(InvalidConfig, match=rf"spec.model.path {missing}: no such directory in this pod"):
        local_model_path(str(missing))
    assert local_model_path(str(tmp_path)) == str(tmp_path)          # there: used as is
    assert local_model_path("org/name") == "org/name"                # a hub id is not a path
