"""Bounded input: JSON nested 100,000 deep (config, hardware, trace) and a config path that is a FIFO, a
symbolic-link loop or a device are one line naming what they are, before any process starts."""

import os

import pytest

from parallelisms.cli import main

DEEP = "[" * 100_000


def _one_error(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_deep_json_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    assert main(["train", "--config", str(deep), "--steps", "1"]) == 2
    assert "is not valid JSON (RecursionError" in _one_error(capsys)
    assert main(["estimate", "--preset", "tiny", "--hardware", str(deep)]) == 2
    assert "not a readable JSON file (RecursionError)" in _one_error(capsys)
    assert main(["plot-trace", str(deep), "--out", str(tmp_path / "t.png")]) == 2
    assert "RecursionError" in _one_error(capsys)


def _special_file(path, kind: str, device: str):
    """``path`` made a FIFO, a symbolic link loop or a dangling link; for ``device``, the device's path."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path, path)
    elif kind == "dangling":
        os.symlink(path.parent / "nowhere", path)
    else:
        return device
    return path


@pytest.mark.parametrize("kind, needle", [("fifo", "is a FIFO"), ("loop", "symbolic link loop"),
                                          ("device", "is a character device"), ("dangling", "dangling symbolic")])
def test_a_config_that_is_not_a_file_is_named_as_what_it_is(kind, needle, tmp_path, capsys):
    path = _special_file(tmp_path / "config.json", kind, "/dev/null")
    assert main(["train", "--config", str(path), "--steps", "1"]) == 2
    assert needle in _one_error(capsys)


# --- sizes against the machine, the tokenizer's ids, config keys, weights, data directories ---

import json  # noqa: E402

from parallelisms.config import ModelConfig, load_hf_config  # noqa: E402
from parallelisms.errors import ConfigError  # noqa: E402

TINY_HF = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _config(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_HF, **changes}))
    return str(path)


@pytest.mark.parametrize("field, needle", [("vocab_size", "does not fit this machine"),
                                           ("max_position_embeddings", "the rotary tables for its 2,147,483,647")])
def test_sizes_near_2_31_are_refused_before_the_allocator(field, needle, tmp_path, capsys):
    """A vocabulary or position count near 2^31 passes the integer bounds; the memory check refuses it."""
    assert main(["train", "--config", _config(tmp_path, **{field: 2**31 - 1}), "--steps", "1"]) == 2
    assert needle in _one_error(capsys)


def test_text_data_larger_than_the_machine_is_refused_before_it_is_read(tmp_path):
    from parallelisms.config import DataConfig
    from parallelisms.data.sources import check_data_size

    text = tmp_path / "big.txt"
    text.write_text("x" * 10_000)
    check_data_size(DataConfig(path=str(text)), ranks=2, available=10**6)
    with pytest.raises(ConfigError, match=r"holds 9.77 KiB of text, which the launcher and 2 rank\(s\) each read .* "
                                          r"pre-tokenize it into a .bin"):
        check_data_size(DataConfig(path=str(text)), ranks=2, available=10**5)


def test_a_tokenizer_whose_ids_exceed_its_entry_count_is_refused(tmp_path):
    """11 entries, but one of them is id 100,000: the model needs a vocabulary of 100,001."""
    tokenizers = pytest.importorskip("tokenizers")
    from parallelisms.config import DataConfig
    from parallelisms.data.sources import check_data

    vocab = {chr(97 + i): i for i in range(10)} | {"[UNK]": 100_000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.txt").write_text("a b c d e f g h i j " * 20)
    cfg = DataConfig(path=str(tmp_path / "data.txt"), tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"has token ids up to 100,000 but the model's vocabulary is 256"):
        check_data(cfg, ModelConfig(), 16)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
def test_the_standard_keys_of_transformers_configs_pass_silently(kind, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(kind, **TINY_HF)
    path = tmp_path / "config.json"
    config.to_json_file(str(path), use_diff=False)
    load_hf_config(path)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("key, value", [("hidden_dropout", 0.1), ("attention_dropout", 0.2),
                                        ("quantization_config", {"quant_method": "gptq"}),
                                        ("final_logit_softcapping", 30.0), ("embedding_multiplier", 12.0)])
def test_keys_that_change_the_computation_are_refused(key, value, tmp_path):
    with pytest.raises(ConfigError, match=f"has {key} .*which changes the computation"):
        load_hf_config(_config(tmp_path, **{key: value}))
    load_hf_config(_config(tmp_path, attention_dropout=0.0, pretraining_tp=1))  # the neutral values pass


def test_unknown_keys_are_named_in_one_warning(tmp_path, capsys):
    load_hf_config(_config(tmp_path, my_extension=3, another_flag=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "another_flag, my_extension" in err[0]


def _hf_dir(tmp_path, layers: int = 2):
    from parallelisms.hf import export_hf
    from parallelisms.model import build_model

    cfg = ModelConfig(n_layers=layers)
    return export_hf(build_model(cfg).state_dict(), cfg, tmp_path / f"hf{layers}")


def _edit_weights(folder, change) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize("case, needle", [
    ("integer", "model.embed_tokens.weight is I64, not floating point"),
    ("extra", "holds 1 tensor(s) its config.json (llama) does not use: model.layers.0.mlp.extra.weight"),
    ("missing", "lacks model.norm.weight"),
    ("shape", "model.norm.weight has shape (32,), its config.json implies (64,)"),
    ("fewer_layers", "holds 3 layers but its config.json has num_hidden_layers 2"),
])
def test_weights_that_disagree_with_the_config_are_one_line_before_launch(case, needle, tmp_path, capsys):
    import torch

    folder = _hf_dir(tmp_path, layers=3 if case == "fewer_layers" else 2)
    if case == "fewer_layers":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    edits = {"integer": lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"].long()}),
             "extra": lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
             "missing": lambda w: w.pop("model.norm.weight"),
             "shape": lambda w: w.update({"model.norm.weight": torch.ones(32)}),
             "fewer_layers": lambda w: None}
    _edit_weights(folder, edits[case])
    assert main(["train", "--init-from", str(folder), "--steps", "1"]) == 2
    assert needle in _one_error(capsys)


def test_old_rotary_buffers_in_weights_are_ignored_as_transformers_ignores_them(tmp_path):
    import torch

    from parallelisms.hf import load_hf_model_config

    folder = _hf_dir(tmp_path)
    _edit_weights(folder, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert load_hf_model_config(folder).n_layers == 2


@pytest.mark.parametrize("kind, needle", [("fifo", "is a FIFO"), ("loop", "is a symbolic link loop"),
                                          ("device", "is a character device")])
def test_data_and_tokenizer_paths_that_are_not_files_are_named(kind, needle, tmp_path, capsys):
    path = _special_file(tmp_path / "data.txt", kind, "/dev/zero")
    assert main(["train", "--data", str(path), "--steps", "1"]) == 2
    assert f"--data {str(path)!r} {needle}" in _one_error(capsys)
    assert main(["train", "--tokenizer", str(path), "--steps", "1"]) == 2
    assert f"--tokenizer {str(path)!r} {needle}" in _one_error(capsys)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello " * 100)
    os.symlink(path, folder / "b.txt")
    assert main(["train", "--data", str(folder), "--steps", "1"]) == 2
    assert f"{str(folder / 'b.txt')!r} {needle}" in _one_error(capsys)


def test_an_unreadable_subdirectory_of_data_is_named(tmp_path, capsys, monkeypatch):
    """A directory this user cannot list (root lists every directory: there the listing is made to fail as it
    fails for another user)."""
    (tmp_path / "a.txt").write_text("hello " * 100)
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "b.txt").write_text("hidden " * 100)
    closed.chmod(0o000)
    if os.geteuid() == 0:
        listing = os.scandir

        def scandir(path="."):
            if str(path) == str(closed):
                raise PermissionError(13, "Permission denied", str(path))
            return listing(path)
        monkeypatch.setattr(os, "scandir", scandir)
    try:
        assert main(["train", "--data", str(tmp_path), "--steps", "1"]) == 2
    finally:
        closed.chmod(0o755)
    assert _one_error(capsys) == (f"error: --data {str(tmp_path)!r}: the subdirectory {str(closed)!r} cannot be "
                                  f"listed (Permission denied); make it readable, or move it out")
