"""blockloop: language models that reuse computation across depth and time."""

from blockloop.errors import BlockloopError, ConfigError

__version__ = "0.1.0"
__all__ = ["BlockloopError", "ConfigError", "__version__"]
