"""Layers point down: models never import the data layer (so they load without the ``tokenizers``
package), the data layer's batching helpers need no config, and every preset runs without ``tokenizers``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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


TESTS = str(Path(__file__).parent)


def run_without_tokenizers(code: str) -> subprocess.CompletedProcess:
    script = BLOCK_TOKENIZERS + f"TESTS = {TESTS!r}\n" + textwrap.dedent(code)
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
        import torch
        from blockloop.families import PRESETS, build_model, collate_for, spec_of
        from blockloop.data.collate import step_generator

        sys.path.insert(0, TESTS)
        from small_presets import small_variant

        for name in PRESETS:
            config = small_variant(name)
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
