"""The encoder tier: MiniLM exported to ONNX, run by ONNX Runtime, and the heads on its embedding.

Nothing here imports PyTorch except :mod:`classifiers.training.export`, and only inside its functions.
"""
