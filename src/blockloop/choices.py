"""The names a user picks from on the command line, defined once and without torch.

Each tuple is the vocabulary of the library code named beside it, which imports it from here. They live
apart from that code so that every ``blockloop VERB --help`` can list the choices at once: the modules that
act on them import torch, and building a parser must not.
"""

SCHEDULES = ("cosine", "linear", "constant")  # train/optim.lr_at: the decay after warm-up
OBJECTIVES = ("lm", "prefix_lm")  # families/spec.FamilySpec.collate: what a training batch scores
PRECISIONS = ("auto", "fp32", "bf16")  # train/trainer: autocast
DISTRIBUTED = ("ddp", "fsdp")  # train/distributed.parallelize
EXIT_LOSSES = ("none", "weighted", "aggressive")  # families/recursive: the early-exit loss over loops
TYING_STRATEGIES = ("cycle", "sequence", "cycle_rev")  # families/recursive: which layer each depth reuses
LOOP_INITS = ("stepwise", "average", "lower", "upper", "random")  # convert/to_recursive: shared-layer init
LORA_INITS = ("svd", "zero")  # convert/to_recursive: per-loop LoRA init
SAVE_DTYPES = ("float32", "bfloat16")  # train/checkpoint: the dtype exported weights are written in
BENCH_DTYPES = ("auto", *SAVE_DTYPES)  # bench/suite.bench_dtype: the weights and caches benchmarks run in
KEY_BUCKETS = 8  # serve/engine.Engine: the key lengths a decode step's keys may be cut to (runners/base.key_lengths)
