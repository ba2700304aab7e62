"""Training: the encoder's export to ONNX (the only import of PyTorch, inside its functions), the
heads' fitting, the learned gates, the guard, the routed models' quality heads, and ``train_all``
(what ``triage train`` runs). Serving never imports this package."""
