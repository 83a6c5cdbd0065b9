"""The Hugging Face architectures blockloop converts, by Hugging Face ``model_type``."""

from blockloop.convert.hf_archs.base import Architecture
from blockloop.convert.hf_archs.gemma3 import GEMMA3
from blockloop.convert.hf_archs.gpt2 import GPT2
from blockloop.convert.hf_archs.gpt_neox import GPT_NEOX
from blockloop.convert.hf_archs.llama import GEMMA, LLAMA, MISTRAL, QWEN2

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (LLAMA, GEMMA, GEMMA3, GPT_NEOX, GPT2, MISTRAL, QWEN2)}

__all__ = ["ARCHITECTURES", "Architecture"]
