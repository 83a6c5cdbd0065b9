"""The models of every paper family: each takes its config and computes (forward and the paper's maths).

Which model a config builds is the family registry's business (:func:`blockloop.families.build_model`).
"""
