"""The next-token loss every family trains and evaluates with, and the target that marks a position unscored.

One definition so that training, evaluation and the early-exit report agree on what a scored position is (a task's
prompt, a PrefixLM prefix, padding and a block model's first block are all unscored) and on the precision of the
softmax: the logits are upcast first, since a bf16 log-softmax over a large vocabulary loses the small terms.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from blockloop.nn.precision import at_least_fp32

# The target of a position that is not scored; cross_entropy's own default, so no call has to name it.
IGNORE_INDEX = -100


def token_cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits (..., V)`` against ``targets (...)`` over the positions not :data:`IGNORE_INDEX`:
    their mean (a model's loss) or sum (nats to add up across batches)."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten(), reduction=reduction,
                           ignore_index=IGNORE_INDEX)
