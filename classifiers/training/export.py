"""Export all-MiniLM-L6-v2 to ONNX (fp32 and dynamic int8), once, into the cache.

Needs the export extras (torch, transformers, onnx); they are imported inside the functions, so
importing this module stays cheap and serving never imports torch. Run it ahead of serving with
``python -m classifiers.training.export`` (prints the export directory).

Steps, in a temporary directory renamed into place at the end (so a crashed or concurrent export
never leaves a half-written cache entry):
1. ``torch.onnx.export`` (the TorchScript exporter, opset 17, dynamic batch and sequence axes) of
   BERT + mean pooling + L2 normalisation, so the graph outputs the sentence embedding itself
   (and, second, the token states after layer ``guard_layer``, which the guard pools);
2. ONNX Runtime's transformer fusions (Attention, EmbedLayerNorm, BiasGelu; not SkipLayerNorm,
   slower on CPU than what it fuses);
3. ``quantize_dynamic``: int8 weights with per-channel scales, uint8 activations quantized at
   run time; the fused Attention becomes QAttention;
4. a check against the PyTorch model on probe sentences (cosines go into the manifest; fp32
   below 0.999 fails the export).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from classifiers.artifacts import (
    MANIFEST,
    PRECISIONS,
    TOKENIZER,
    Artifacts,
    ExportSettings,
    artifacts_for,
    source_dir,
    source_hash,
)
from policies.errors import NotReady

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "sentence_embedding"
TOKENS = "guard_tokens"  # the hidden state after ExportSettings.guard_layer, unpooled: the guard pools it
FP32_MIN_COSINE = 0.999
VERSIONED = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu")
PROBES = (
    "What is the capital of France?",
    "Is this email spam? Buy now, limited offer!!!",
    "Rate the movie from 1 to 10: it was fine, nothing special.",
    "",
    "Which of the following is a prime number? A) 4 B) 6 C) 7 D) 9",
)


def ensure_exported(
    source: Path | None = None,
    settings: ExportSettings | None = None,
    cache_root: Path | None = None,
) -> tuple[Artifacts, bool]:
    """The export for ``source`` and ``settings``: reused if cached, else built. Returns (artifacts, built)."""
    src = source if source is not None else source_dir()
    opts = settings or ExportSettings()
    digest = source_hash(src)
    art = artifacts_for(src, opts, cache_root, source_sha256=digest)
    if art.complete():
        return art, False
    art.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{art.root.name}-", dir=art.root.parent))
    tmp.chmod(0o755)
    try:
        manifest = _export_into(src, tmp, opts)
        manifest.update(key=art.key, source=str(src), source_sha256=digest, settings=asdict(opts))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        try:
            os.replace(tmp, art.root)
        except OSError:
            if not art.complete():  # not a concurrent export that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return art, True


def _export_into(src: Path, out: Path, opts: ExportSettings) -> dict[str, Any]:
    try:
        import torch
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise NotReady(f"exporting the encoder needs torch and transformers ({exc})") from exc

    hf_logging.disable_progress_bar()

    torch.manual_seed(0)
    bert = AutoModel.from_pretrained(str(src), attn_implementation="eager", local_files_only=True).eval()
    if not 1 <= opts.layers <= bert.config.num_hidden_layers:
        raise NotReady(f"the encoder has {bert.config.num_hidden_layers} layers; cannot keep {opts.layers}")
    if opts.layers < bert.config.num_hidden_layers:  # the first N layers; the heads are trained on what they give
        bert.encoder.layer = bert.encoder.layer[: opts.layers]
        bert.config.num_hidden_layers = opts.layers
    wrapped = _pooled(torch, bert, min(opts.guard_layer, opts.layers))
    fp32 = out / "model-fp32.onnx"
    raw = out / "raw-fp32.onnx"
    _torch_export(torch, wrapped, raw, opts.opset)
    if opts.fuse:
        _fuse(raw, fp32, num_heads=bert.config.num_attention_heads, hidden_size=bert.config.hidden_size)
        raw.unlink()
    else:
        raw.rename(fp32)
    quantize(fp32, out / "model-int8.onnx", per_channel=opts.int8_per_channel)
    shutil.copyfile(src / TOKENIZER, out / TOKENIZER)
    cosines = _check(torch, wrapped, src, out)
    if cosines["fp32"] < FP32_MIN_COSINE:
        raise NotReady(f"ONNX fp32 export disagrees with PyTorch: min cosine {cosines['fp32']:.5f}")
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "dim": int(bert.config.hidden_size),
        "layers": int(bert.config.num_hidden_layers),
        "max_position_embeddings": int(bert.config.max_position_embeddings),
        "inputs": list(INPUTS),
        "output": OUTPUT,
        "token_output": TOKENS,
        "guard_layer": min(opts.guard_layer, opts.layers),
        "pooling": "mean over attention_mask, then L2 normalisation (in the graph)",
        "min_cosine_vs_pytorch": cosines,
        "versions": {name: _version(name) for name in VERSIONED},
    }


def _pooled(torch: Any, bert: Any, guard_layer: int) -> Any:
    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            out = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
                output_hidden_states=True,
            )
            tokens = out.last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1), out.hidden_states[guard_layer]

    return Pooled().eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters' deprecation and tracer notices and the quantizer's advice are expected here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)


def _torch_export(torch: Any, model: Any, path: Path, opset: int) -> None:
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    axes = {"batch": 0, "seq": 1}
    dynamic = {name: {v: k for k, v in axes.items()} for name in INPUTS}
    dynamic[OUTPUT] = {0: "batch"}
    dynamic[TOKENS] = {0: "batch", 1: "seq"}
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            model,
            (ids, (ids != 0).to(torch.int64)),
            str(path),
            input_names=list(INPUTS),
            output_names=[OUTPUT, TOKENS],
            dynamic_axes=dynamic,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )


def _fuse(src: Path, dst: Path, *, num_heads: int, hidden_size: int) -> None:
    """ONNX Runtime's BERT fusions but SkipLayerNormalization: on CPU here its kernel is slower
    than the Add and LayerNormalization it fuses (``python -m benchmarks encoder``, ``onnx-int8-sln``; the
    encoder turns the same fusion off in its sessions)."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    fusions = FusionOptions("bert")
    fusions.enable_skip_layer_norm = False
    fusions.enable_bias_skip_layer_norm = False
    with _quiet():
        model = optimizer.optimize_model(
            str(src),
            model_type="bert",
            num_heads=num_heads,
            hidden_size=hidden_size,
            opt_level=0,
            use_gpu=False,
            optimization_options=fusions,
        )
        model.save_model_to_file(str(dst))


def quantize(src: Path, dst: Path, *, per_channel: bool) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(
            str(src),
            str(dst),
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )


def _check(torch: Any, model: Any, src: Path, out: Path) -> dict[str, float]:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / TOKENIZER))
    tok.no_truncation()
    tok.no_padding()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sessions = {
        p: ort.InferenceSession(str(out / f"model-{p}.onnx"), opts, providers=["CPUExecutionProvider"])
        for p in PRECISIONS
    }
    worst: dict[str, float] = dict.fromkeys(PRECISIONS, 1.0)
    for text in PROBES:
        ids = np.array([tok.encode(text).ids], dtype=np.int64)
        mask = np.ones_like(ids)
        with torch.no_grad():
            ref = model(torch.from_numpy(ids), torch.from_numpy(mask))[0].numpy()[0]
        for p, sess in sessions.items():
            got = sess.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})[0][0]
            worst[p] = min(worst[p], float(np.dot(ref, got) / (np.linalg.norm(ref) * np.linalg.norm(got))))
    return worst


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m classifiers.training.export", description="Export the encoder to ONNX."
    )
    parser.add_argument("--layers", type=int, default=ExportSettings().layers, help="keep the first N layers")
    args = parser.parse_args(argv)
    art, built = ensure_exported(settings=ExportSettings(layers=args.layers))
    print(f"{'exported' if built else 'cached'}: {art.root}")


if __name__ == "__main__":
    main()
