import json

from safetensors import safe_open

from sglang_ext import model


def test_embedded_model_is_a_complete_hf_folder(model_path):
    config = json.loads((model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    with safe_open(str(model_path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert len(names) == 2 + 9 * config["num_hidden_layers"]  # embed, final norm, 9 per layer
    assert str(embed.dtype) == "torch.bfloat16" and tuple(embed.shape) == (49152, 576)
    assert "im_start" in (model_path / "chat_template.jinja").read_text()
    assert (model_path / "tokenizer.json").is_file()
    tokenizer_config = json.loads((model_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    generation = json.loads((model_path / "generation_config.json").read_text())
    assert (generation["temperature"], generation["eos_token_id"]) == (0.2, 2)


def test_conversion_is_reused(model_path):
    before = (model_path / "model.safetensors").stat().st_mtime_ns
    assert model.default_model_path() == model_path
    assert (model_path / "model.safetensors").stat().st_mtime_ns == before


def test_an_older_conversion_is_redone(monkeypatch, tmp_path):
    monkeypatch.setenv(model.CACHE_ENV, str(tmp_path))
    stale = tmp_path / model.MODEL_NAME
    stale.mkdir()
    (stale / model._COMPLETE_MARKER).write_text('{"source": "x"}')
    converted = []
    monkeypatch.setattr(model, "convert_gguf", lambda source, target: converted.append(target))
    model.default_model_path()
    assert converted == [stale]


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv(model.CACHE_ENV, str(tmp_path))
    assert model.cache_dir() == tmp_path


def test_gguf_is_found_without_importing_its_package():
    import sys

    path = model.gguf_path()
    assert path.name == model.GGUF_FILE and path.stat().st_size > 90_000_000
    assert model.GGUF_PACKAGE not in sys.modules
