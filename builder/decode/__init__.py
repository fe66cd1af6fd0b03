"""Greedy decoding, plain and speculative: one loop (loop.py) over backends for PyTorch, onnxruntime and the drafter."""
