"""A floor for the encoder's latency on this CPU: its dense layers' matrix products alone.

Every transformer layer of the export multiplies the token states by four weight matrices (the
fused query/key/value projection, the attention output, the feed-forward up and down). The floor
graph is those products and nothing else, chained layer after layer with the encoder's own fp32
weights, then int8-quantized by the export's own quantizer, and run by ONNX Runtime on one
thread: no tokenizer, embedding, attention scores, softmax, layer norms, GELU, pooling or heads.
A latency goal below this floor cannot be met on this CPU by tuning the rest of the graph; it
takes fewer or smaller layers, or an int8 dot-product instruction set (AVX-VNNI, AVX-512 VNNI,
AMX) or a GPU.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.encoder_backends import Contestant, Forward
from classifiers.artifacts import Artifacts
from classifiers.encoder import Encoder
from classifiers.training.export import quantize

INT8_FLOOR = "int8-matmuls-only"
_PROJECTIONS = ("Attention", "MatMul")  # the fp32 export's fused QKV projection, and the other three per layer


def layer_weights(fp32_model: Path) -> list[np.ndarray]:
    """The 2-D weight of every projection in the fp32 export, in graph order (4 per layer)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(fp32_model))
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type in _PROJECTIONS and len(node.input) > 1 and node.input[1] in inits:
            w = numpy_helper.to_array(inits[node.input[1]])
            if w.ndim == 2:
                out.append(w.astype(np.float32))
    return out


def chain_model(weights: Sequence[np.ndarray], dst: Path) -> Path:
    """An ONNX graph of the products alone: per layer, the states ``x`` times the QKV weight (an
    output of its own), and ``x`` through the output, up and down weights in turn (the next ``x``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    hidden = weights[0].shape[0]
    nodes, inits, outputs, x = [], [], [], "x"
    for i, w in enumerate(weights):
        name = f"w{i}"
        inits.append(numpy_helper.from_array(w, name))
        y = f"y{i}"
        nodes.append(helper.make_node("MatMul", [x, name], [y]))
        if w.shape[1] == 3 * hidden:  # the QKV projection reads x and feeds nothing further here
            outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, None))
        else:
            x = y
    outputs.insert(0, helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "matmul-floor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", hidden])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(dst))
    return dst


def floor_contestant(art: Artifacts, probe: Encoder, *, per_channel: bool = True) -> Contestant:
    """A one-thread contestant whose ``forward(texts)`` runs the int8 floor graph on random states of
    each text's token count (as the encoder keeps it): latency only, its output means nothing."""
    import onnxruntime as ort

    weights = layer_weights(art.model("fp32"))
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = chain_model(weights, Path(tmp) / "floor-fp32.onnx")
        int8 = Path(tmp) / "floor-int8.onnx"
        quantize(fp32, int8, per_channel=per_channel)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(int8), opts, providers=["CPUExecutionProvider"])
    hidden = weights[0].shape[0]
    states: dict[str, np.ndarray] = {}  # by text: its token count is read once, outside the timing that matters
    rng = np.random.default_rng(0)

    def forward(texts: Sequence[str]) -> np.ndarray:
        out = []
        for text in texts:
            if text not in states:
                n = len(probe.encode(text, parts=False).ids)
                states[text] = rng.standard_normal((n, hidden)).astype(np.float32)
            out.append(session.run(None, {"x": states[text]})[0][0])
        return np.stack(out)

    forwards: dict[int, Forward] = {1: forward}
    return Contestant(INT8_FLOOR, forwards, lambda n: None)
