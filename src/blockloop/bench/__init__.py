"""Inference benchmarks: the Block Transformer paper's throughput protocol, a request stream, and plots."""
