"""Layers point down: models never import the data layer (so they load without the ``tokenizers``
package), the data layer's batching helpers need no config, and every preset runs without ``tokenizers``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TOKENIZERS = textwrap.dedent(
    """
    import sys

    class NoTokenizers:
        def find_spec(self, name, path=None, target=None):
            if name == "tokenizers" or name.startswith("tokenizers."):
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, NoTokenizers())
    """
)


def run_without_tokenizers(code: str) -> subprocess.CompletedProcess:
    script = BLOCK_TOKENIZERS + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_models_import_neither_data_nor_families():
    run_without_tokenizers(
        """
        import importlib, pkgutil
        import blockloop.models
        for module in pkgutil.iter_modules(blockloop.models.__path__):
            importlib.import_module(f"blockloop.models.{module.name}")
        loaded = [m for m in sys.modules if m.startswith(("blockloop.data", "blockloop.families", "tokenizers"))]
        assert not loaded, loaded
        """
    )


def test_partitions_do_not_import_config():
    run_without_tokenizers(
        """
        import blockloop.data.partitions
        assert "blockloop.config" not in sys.modules
        """
    )


def test_every_preset_tiny_variant_builds_and_runs_a_forward_without_tokenizers():
    result = run_without_tokenizers(
        """
        import dataclasses
        import torch
        from blockloop.families import PRESETS, build_model, collate_for, from_name, spec_of
        from blockloop.data.collate import step_generator

        def tiny(config):
            fields = {f.name for f in dataclasses.fields(config)}
            o = {"vocab_size": 64, "padded_vocab_size": 64 + config.reserved_ids}
            if "d_model" in fields:
                o.update(n_layer=2, d_model=32, n_head=2, n_kv_head=2, head_dim=None, d_ff=None)
            if "n_context_layer" in fields:
                o.update(n_context_layer=1, n_generation_layer=1)
            if "n_encoder_layer" in fields:
                o.update(n_encoder_layer=1, n_decoder_layer=1)
            if "block_d_model" in fields:
                shape = dict(n_layer=1, d_model=32, n_head=2, n_kv_head=None, d_ff=None)
                o.update({f"{part}_{k}": v for part in ("block", "token") for k, v in shape.items()})
                o.update(embed_dim=None, embedder_n_layer=1, embedder_n_head=2)
            return from_name(config.name, **o)

        for name in PRESETS:
            config = tiny(from_name(name))
            multiple = spec_of(config).sequence_multiple(config)
            length = min(config.context_length, -(-16 // multiple) * multiple)
            torch.manual_seed(0)
            model = build_model(config).eval()
            window = torch.randint(0, 64, (2, length + 1))
            batch = collate_for(config)(window[:, :-1], window[:, 1:], step_generator(0, 0))
            with torch.no_grad():
                logits, loss = model(**batch)[:2]
            assert torch.isfinite(logits).all() and torch.isfinite(loss), name
        assert "tokenizers" not in sys.modules
        print(len(PRESETS))
        """
    )
    assert int(result.stdout.split()[-1]) >= 60
