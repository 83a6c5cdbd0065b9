"""Hugging Face import/export: logits equal transformers' for every architecture, cached generation, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.config import DecoderConfig
from blockloop.convert.hf import export_hf, from_hf_model, import_hf, to_hf_model
from blockloop.data.tokenizers import ByteTokenizer, HFTokenizer
from blockloop.errors import BlockloopError
from blockloop.models.decoder import Decoder
from blockloop.serve.generate import generate
from blockloop.train.run import load_trained

TOL = 1e-4
SEQ = 24
SMALL = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "max_position_embeddings": 64}


def _llama(**kw):
    return transformers.LlamaConfig(**SMALL, num_key_value_heads=4, **kw)


def _llama_gqa(**kw):
    return transformers.LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **kw)


def _gemma(**kw):
    return transformers.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16, **kw)


def _gemma3(**kw):
    return transformers.Gemma3TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}, **kw)


def _neox(**kw):
    return transformers.GPTNeoXConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5}, **kw)


def _gpt2(**kw):
    return transformers.GPT2Config(**{"vocab_size": 97, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64, **kw})


def _mistral(**kw):  # every layer within a window shorter than the test sequence
    return transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=5, **kw)


def _mistral_global(**kw):  # no window: a Llama by another name
    return transformers.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=True,
                                      **kw)


def _qwen2(**kw):  # biases on q, k and v only
    return transformers.Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True, **kw)


def _qwen2_windowed(**kw):  # its last layers within a window shorter than the test sequence
    return transformers.Qwen2Config(**SMALL, num_key_value_heads=1, use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1, **kw)


CONFIGS = {"qwen2": _qwen2, "qwen2_windowed": _qwen2_windowed, "llama": _llama, "llama_gqa": _llama_gqa, "gemma": _gemma, "gemma3": _gemma3, "gpt_neox": _neox,
           "gpt2": _gpt2, "mistral": _mistral, "mistral_global": _mistral_global}


def random_hf_model(kind: str, seed: int = 0):
    """A tiny randomly initialised transformers model; norms and biases perturbed so they are not identities."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def char_tokenizer(vocab: int) -> HFTokenizer:
    """A character tokenizer with ``vocab`` ids (the last is end-of-text): exports need one that fits the model."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.BPE(vocab={chr(ord("0") + i): i for i in range(vocab - 1)}, merges=[]))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return HFTokenizer(tokenizer, "chars", vocab - 1)


def tokens(vocab: int = 97, batch: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_import_matches_transformers(kind):
    hf = random_hf_model(kind)
    ours = from_hf_model(hf)
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
        got, _ = ours(idx)
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= TOL
    assert expected.abs().max() > 0.1  # a real signal, not two sets of zeros
    # built on the meta device, it owns its weights: tied ones one Parameter, none shared with the source
    assert (ours.lm_head.weight is ours.embed.weight) == ours.config.tie_embeddings
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert not any(p.untyped_storage().data_ptr() in theirs for p in ours.parameters())
    assert not any(p.is_meta for p in ours.parameters())


def test_mistral_sliding_window_is_active_on_every_layer():
    hf = random_hf_model("mistral")
    ours = from_hf_model(hf)
    assert ours.config.local_layers == [0, 1, 2] and ours.config.sliding_window == 5 < SEQ
    global_only = Decoder(ours.config.replace(local_layers=[], sliding_window=None))
    global_only.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert max_diff(global_only.eval()(tokens())[0], hf(tokens()).logits) > 1e-3
    assert from_hf_model(random_hf_model("mistral_global")).config.local_layers == []


def test_qwen2_has_biases_on_q_k_v_alone_and_its_window_on_the_layers_it_names():
    ours = from_hf_model(random_hf_model("qwen2_windowed"))
    c = ours.config
    assert (c.bias, c.qkv_bias, c.local_layers, c.sliding_window) == (False, True, [1, 2], 5)
    block = ours.body.blocks[0]
    assert block.attn.qkv.bias is not None and block.attn.proj.bias is None and block.mlp.up.bias is None
    global_only = Decoder(c.replace(local_layers=[], sliding_window=None))
    global_only.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert max_diff(global_only.eval()(tokens())[0], random_hf_model("qwen2_windowed")(tokens()).logits) > 1e-3


def test_gemma3_sliding_window_is_active():
    """The test sequence is longer than the window, so dropping the local layers' window changes logits."""
    hf = random_hf_model("gemma3")
    ours = from_hf_model(hf)
    assert ours.config.local_layers == [0, 2] and ours.config.sliding_window < SEQ
    idx = tokens()
    global_only = Decoder(ours.config.replace(local_layers=[], sliding_window=None, local_rope_base=None))
    global_only.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert max_diff(global_only.eval()(idx)[0], hf(idx).logits) > 1e-3


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma3", "gpt2", "gpt_neox", "mistral", "qwen2_windowed"])
def test_cached_generation_equals_full_forward(kind):
    """Greedy generation through the decoder's runner (two prompts of different lengths in one batch)
    picks, at every step, the argmax of a full uncached forward over the row's own tokens."""
    model = from_hf_model(random_hf_model(kind))
    prompts = [tokens(batch=1, length=9, seed=3)[0].tolist(), tokens(batch=1, length=4, seed=4)[0].tolist()]
    new = generate(model, prompts, max_new_tokens=10, temperature=0.0)
    for prompt, row in zip(prompts, new):
        assert len(row) == 10
        seq = torch.tensor([prompt + row])
        with torch.no_grad():
            logits, _ = model(seq[:, :-1])
        assert logits[0, len(prompt) - 1:].argmax(-1).tolist() == row


def test_folder_import_and_export_round_trip(tmp_path):
    hf = random_hf_model("llama_gqa")
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf")
    assert ours.config.name == "hf" and not ours.training
    out = export_hf(ours, char_tokenizer(97), tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = tokens()
    with torch.no_grad():
        assert max_diff(reloaded(idx).logits, ours(idx)[0]) <= TOL


@pytest.mark.parametrize(
    "config",
    [
        DecoderConfig(vocab_size=90, padded_vocab_size=128, context_length=32, n_layer=2, n_head=4, d_model=32,
                      rotary_pct=0.25, parallel_residual=True),  # Pythia style -> GPT-NeoX
        DecoderConfig(vocab_size=90, context_length=32, n_layer=2, n_head=4, d_model=32),  # sequential residual
        DecoderConfig(vocab_size=90, context_length=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, norm="rmsnorm",
                      mlp="swiglu", bias=False, tie_embeddings=False),  # Llama shape
        DecoderConfig(vocab_size=90, context_length=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, norm="rmsnorm",
                      mlp="swiglu", bias=False, local_layers=[0, 1], sliding_window=6),  # every layer local: Mistral
        DecoderConfig(vocab_size=90, context_length=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, norm="rmsnorm",
                      mlp="swiglu", bias=False, qkv_bias=True, local_layers=[1], sliding_window=6),  # Qwen2
    ],
    ids=["neox", "neox_sequential", "llama", "mistral", "qwen2"],
)
def test_export_native_decoders(config, tmp_path):
    torch.manual_seed(0)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model, char_tokenizer(90), tmp_path / "x"), dtype=torch.float32)
    idx = tokens(vocab=90)
    with torch.no_grad():
        assert max_diff(hf.eval()(idx).logits, model(idx)[0]) <= TOL
    assert json.loads((tmp_path / "x" / "config.json").read_text())["vocab_size"] == config.padded_vocab_size


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_weights_round_trip_through_the_key_map(kind):
    hf = random_hf_model(kind)
    back = to_hf_model(from_hf_model(hf))
    theirs, ours = hf.state_dict(), back.state_dict()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32))
    hf.save_pretrained(tmp_path / "opt")
    with pytest.raises(BlockloopError, match=r"unsupported Hugging Face architecture 'opt'; supported: llama, .*gpt2"):
        import_hf(tmp_path / "opt")


def test_bad_paths_and_inexpressible_models(tmp_path):
    with pytest.raises(BlockloopError, match="not a directory"):
        import_hf(tmp_path / "missing")
    with pytest.raises(BlockloopError, match="no config.json"):
        import_hf(tmp_path)
    with pytest.raises(BlockloopError, match="no GGUF file"):
        import_hf(tmp_path, gguf_file="model.gguf")
    with pytest.raises(BlockloopError, match="RoPE scaling"):
        from_hf_model(transformers.AutoModelForCausalLM.from_config(_llama(rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})))
    mup = DecoderConfig(vocab_size=90, context_length=32, n_layer=1, n_head=4, d_model=32, mup_base_width=16)
    with pytest.raises(BlockloopError, match="matches no Hugging Face architecture"):
        export_hf(Decoder(mup), char_tokenizer(90), tmp_path / "mup")
    # the field that stops an export is named (q/k norms in an otherwise Llama-shaped model)
    qk = DecoderConfig(vocab_size=90, context_length=32, n_layer=1, n_head=4, d_model=32, norm="rmsnorm", mlp="swiglu",
                       qk_norm=True)
    with pytest.raises(BlockloopError, match="the closest, llama, cannot express qk_norm=True"):
        export_hf(Decoder(qk), char_tokenizer(90), tmp_path / "qk")
    # an architecture's own refusal is given too (GPT-NeoX cannot rotate 12 x 0.25 = 3 channels)
    odd = DecoderConfig(vocab_size=90, context_length=32, n_layer=1, d_model=48, n_head=4, rotary_pct=0.25)
    with pytest.raises(BlockloopError, match="gpt_neox: an odd rotary width 3"):
        export_hf(Decoder(odd), char_tokenizer(90), tmp_path / "odd")


def test_cli_import_generate_and_export(tmp_path, capsys):
    """convert --from-hf writes a checkpoint that load_trained/generate read; --to hf exports it back."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_gpt2(vocab_size=260)).eval()
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--tokenizer", "byte", "--out", str(run)]) == 0
    trained = load_trained(run)
    assert trained.tokenizer.name == "byte" and trained.state["run"]["tokenizer"] == "byte"
    idx = tokens(vocab=256)
    with torch.no_grad():
        assert max_diff(trained.model(idx)[0], hf(idx).logits) <= TOL
    assert main(["generate", "--checkpoint", str(run), "--prompt", "to be", "--max-new-tokens", "5"]) == 0
    assert main(["convert", "--to", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert max_diff(back(idx).logits, hf(idx).logits) <= TOL


def test_an_import_writes_bfloat16_weights_when_asked(tmp_path, capsys):
    """--save-dtype bfloat16 on an import writes the weights a --to weights copy of the float32 import would (it was
    refused, and a 2-step import-then-copy held the float32 checkpoint on disk in between)."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_gpt2(vocab_size=260)).save_pretrained(tmp_path / "hf")
    source = ["convert", "--from-hf", str(tmp_path / "hf"), "--tokenizer", "byte"]
    assert main([*source, "--out", str(tmp_path / "fp32")]) == 0
    assert main([*source, "--save-dtype", "bfloat16", "--out", str(tmp_path / "bf16")]) == 0
    assert "parameters in bfloat16" in capsys.readouterr().out
    assert main(["convert", "--to", "weights", "--save-dtype", "bfloat16", "--checkpoint", str(tmp_path / "fp32"),
                 "--out", str(tmp_path / "copy")]) == 0
    written, copied = (load_file(tmp_path / name / "model.safetensors") for name in ("bf16", "copy"))
    assert written.keys() == copied.keys() and all(t.dtype == torch.bfloat16 for t in written.values())
    assert all(torch.equal(written[name], copied[name]) for name in written)
    model = load_trained(tmp_path / "bf16").model  # loads back into float32
    assert next(model.parameters()).dtype == torch.float32


def one_line_error(capsys, argv, match):
    capsys.readouterr()
    assert main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and match in err, err


def test_cli_errors(tmp_path, capsys):
    one_line_error(capsys, ["convert", "--out", str(tmp_path / "x")], "give either --from-hf")
    one_line_error(capsys, ["convert", "--from-hf", "x", "--to", "hf", "--out", str(tmp_path / "x")], "give either")
    one_line_error(capsys, ["convert", "--to", "hf", "--out", str(tmp_path / "x")], "needs --checkpoint")
    one_line_error(capsys, ["convert", "--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                   "is not a directory")
    (tmp_path / "notes").mkdir()  # no model at all: that is the first thing said, not the missing tokenizer
    one_line_error(capsys, ["convert", "--from-hf", str(tmp_path / "notes"), "--out", str(tmp_path / "x")],
                   "no config.json in")
    hf = random_hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    one_line_error(capsys, ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "x")],
                   "no tokenizer.json")
    one_line_error(capsys, ["convert", "--from-hf", str(tmp_path / "hf"), "--tokenizer", "byte", "--out",
                            str(tmp_path / "x")], "has 258 ids but the model only 97")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    """The real SmolLM2-135M (Q4_1 GGUF, dequantised): blockloop's import (its GGUF parsed once) gives the logits
    of the model transformers loads by itself on real text."""
    from blockloop.convert.smollm2 import import_smollm2
    from blockloop.data.pretrained import SMOLLM2_GGUF, quiet_transformers, smollm2_files
    from blockloop.data.tokenizers import build_tokenizer

    ours = import_smollm2()
    with quiet_transformers():
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_files(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True).eval()
    tok = build_tokenizer("smollm2")
    idx = torch.tensor([tok.encode("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.")])
    with torch.no_grad():
        diff = max_diff(ours(idx)[0], hf(idx).logits)
    assert diff <= TOL, diff


def test_a_gguf_is_parsed_once_inside_the_context_and_gguf_is_itself_again_after(tmp_path):
    """Inside :func:`gguf_parsed_once` (nested too) a file's reader and a name table are built once; outside,
    each call builds its own, as transformers expects."""
    gguf = pytest.importorskip("gguf")
    from blockloop.data.pretrained import gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llama = gguf.MODEL_ARCH.LLAMA
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        with gguf_parsed_once():
            assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        assert first.get_tensor(0).data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
    assert gguf.get_tensor_name_map(llama, 2) is not gguf.get_tensor_name_map(llama, 2)


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """A tiny byte-tokenizer decoder (258 ids, 320 embedding rows, as runs pad it) and its Hugging Face export."""
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=258, padded_vocab_size=320, context_length=64, n_layer=2, n_head=4, n_kv_head=2,
                           d_model=32, norm="rmsnorm", mlp="swiglu", bias=False)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, export_hf(model, ByteTokenizer(), tmp_path_factory.mktemp("export") / "hf")


def test_reimported_export_samples_only_tokenizer_ids(byte_export, tmp_path):
    """The export writes all 320 rows as Hugging Face's vocabulary; the re-import takes the tokenizer's 258 ids
    as vocab_size again, so the other rows stay padding that sampling never picks, and the logits are the same."""
    model, folder = byte_export
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    back = load_trained(tmp_path / "run").model
    assert (back.config.vocab_size, back.config.padded_vocab_size) == (258, 320)
    idx = tokens(vocab=258)
    with torch.no_grad():
        assert max_diff(back(idx)[0][..., :258], model(idx)[0][..., :258]) <= TOL
    sampled = generate(back, [[1, 2, 3]] * 4, max_new_tokens=40, temperature=100.0, seed=0)
    assert max(max(row) for row in sampled) < 258


CORRUPTIONS = {
    "bad_json": (lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON"),
    "bad_field": (lambda d: _edit_config(d, hidden_size="abc"), "config.json is not a readable model config"),
    "bad_dtype": (lambda d: _edit_config(d, dtype="float8"), "not a readable model config (AttributeError: "),
    # fields transformers reads only as it builds the model
    "bad_activation": (lambda d: _edit_config(d, hidden_act="weird"),
                       "config.json describes a model transformers cannot build (KeyError: 'weird')"),
    "bad_rope_type": (lambda d: _edit_config(d, rope_scaling={"rope_type": "weird", "factor": 2.0}),
                      "config.json describes a model transformers cannot build"),
    "pad_past_vocab": (lambda d: _edit_config(d, vocab_size=100, pad_token_id=257),
                       "config.json describes a model transformers cannot build (AssertionError: "),
    "truncated": (lambda d: _truncate(d / "model.safetensors", 500), "model.safetensors cannot be read"),
    "torn": (lambda d: _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 100),
             "model.safetensors cannot be read"),
    "wider": (lambda d: _edit_config(d, hidden_size=64), "is [320, 32] there but the config makes it [320, 64]"),
    "deeper": (lambda d: _edit_config(d, num_hidden_layers=3), "it lacks model.layers.2."),
    "shallower": (lambda d: _edit_config(d, num_hidden_layers=1), "it holds model.layers.1."),
}


def _edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def _truncate(path, size):
    with path.open("r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_or_mismatched_folder_is_one_line_error(case, byte_export, tmp_path, capsys):
    """A broken config.json or weights file, or weights of another shape, is named in one line (transformers
    would raise a paragraph, or load the mismatch with random weights); nothing is written to --out."""
    corrupt, message = CORRUPTIONS[case]
    folder = shutil.copytree(byte_export[1], tmp_path / "hf")
    corrupt(folder)
    one_line_error(capsys, ["convert", "--from-hf", str(folder), "--out", str(tmp_path / "run")], message)
    assert not (tmp_path / "run").exists()


def test_gemma3_style_decoder_with_default_scales_exports(tmp_path):
    """attn_scalar=None (head_dim) and local_rope_base=None (the global base) are what Gemma-3 writes out as
    query_pre_attn_scalar=head_dim and one rotary base for both layer types: the export takes them."""
    config = DecoderConfig(vocab_size=90, context_length=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32, head_dim=8,
                           norm="rmsnorm1p", mlp="geglu", bias=False, embed_scale=True, qk_norm=True,
                           sandwich_norm=True, sliding_window=4, local_layers=[0])
    torch.manual_seed(0)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = to_hf_model(model)
    assert hf.config.model_type == "gemma3_text"
    idx = tokens(vocab=90)
    with torch.no_grad():
        assert max_diff(hf(idx).logits, model(idx)[0]) <= TOL


def test_a_broken_shard_is_named(byte_export, tmp_path, capsys):
    """A sharded model's error named "the .safetensors files in FOLDER"; it names the shard that does not read."""
    sharded = tmp_path / "hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(byte_export[1], dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(byte_export[1] / "tokenizer.json", sharded / "tokenizer.json")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    _truncate(shards[1], 100)
    one_line_error(capsys, ["convert", "--from-hf", str(sharded), "--out", str(tmp_path / "run")],
                   f"{shards[1]} cannot be read, it is corrupt or incomplete")
