"""The encoder tier's encoder: real packaged MiniLM, exported once per session into a temp cache."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from classifiers.artifacts import Artifacts, ExportSettings, locate, source_dir, source_hash
from classifiers.batching import MicroBatcher
from classifiers.encoder import Encoder, EncoderSettings
from classifiers.training.export import ensure_exported
from policies.errors import InvalidRequest, NotReady
from tests import lanes

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "What is the capital of France?",
    "Is this email spam? Buy now, limited offer!!!",
    "Rate the movie from 1 to 10: it was fine, nothing special.",
    "Explain how a transformer encoder turns tokens into a sentence embedding, step by step. " * 4,
    "",
    "yes",
    "Which of the following is a prime number? A) 4 B) 6 C) 7 D) 9",
    "Combien de pattes a une araignée ?",
    "def add(a, b):\n    return a + b\n# what does this return for add(2, 3)?",
]
# int8 kernels differ between CPUs (AVX2, AVX-512, VNNI, AMX), and so do the last digits of every
# int8 result: the worst cosine of a row to its fp32/PyTorch twin was ~0.97 on an AVX2 host and 0.947
# on an AVX-512 VNNI one. What the code guarantees is asserted exactly (rows apart are bit-equal
# whatever their batch); what the kernels decide is bounded by ranking (each row is nearest its own
# twin, far from every other prompt's) and by a floor well below every kernel measured.
INT8_FLOOR_COSINE = 0.90
INT8_MEAN_COSINE = 0.97


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def assert_twins(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Each row of ``got`` is nearer its own row of ``want`` than any other row, and above the floor."""
    a = got / np.linalg.norm(got, axis=1, keepdims=True)
    b = want / np.linalg.norm(want, axis=1, keepdims=True)
    sim = a @ b.T
    assert (sim.argmax(1) == np.arange(len(sim))).all(), sim.round(3)
    own = np.diag(sim)
    assert own.min() > INT8_FLOOR_COSINE, own.round(4)
    return own


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triage-cache")


@pytest.fixture(scope="session")
@lanes.model
def exported(cache_root: Path) -> Artifacts:
    art, built = ensure_exported(cache_root=cache_root)
    assert built
    return art


@pytest.fixture(scope="session")
def fp32(exported: Artifacts) -> Encoder:
    return Encoder.load(EncoderSettings(precision="fp32"), artifacts=exported)


@pytest.fixture(scope="session")
def int8(exported: Artifacts) -> Encoder:
    return Encoder.load(EncoderSettings(precision="int8"), artifacts=exported)


@pytest.fixture(scope="session")
@lanes.model
def reference() -> np.ndarray:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(str(source_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False)


def test_fp32_matches_sentence_transformers(fp32: Encoder, reference: np.ndarray) -> None:
    got = fp32.embed(TEXTS)
    assert got.shape == (len(TEXTS), 384)
    assert got.dtype == np.float32
    assert cosines(got, reference).min() > 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_int8_is_close_to_sentence_transformers(int8: Encoder, reference: np.ndarray) -> None:
    got = np.stack([int8.embed_one(t) for t in TEXTS])
    cos = assert_twins(got, reference)
    print(f"int8 vs sentence-transformers: mean cosine {cos.mean():.4f}, min {cos.min():.4f}")
    assert cos.mean() > INT8_MEAN_COSINE


def test_manifest_records_the_export(exported: Artifacts) -> None:
    manifest = json.loads(exported.manifest_path.read_text())
    assert manifest["key"] == exported.key
    assert manifest["source_sha256"] == source_hash(source_dir())
    assert manifest["min_cosine_vs_pytorch"]["fp32"] > 0.999
    assert exported.model("int8").stat().st_size < exported.model("fp32").stat().st_size / 3


def test_the_export_fuses_attention_but_not_skip_layer_norm(exported: Artifacts, tmp_path: Path) -> None:
    """SkipLayerNormalization is slower on CPU than the Add and LayerNormalization it fuses: neither
    the export nor the encoder's sessions (their optimized graph, dumped here) have it."""
    import onnx

    from classifiers.encoder import EncoderSettings, _open

    ops = {n.op_type for n in onnx.load(str(exported.model("int8"))).graph.node}
    assert "QAttention" in ops and "LayerNormalization" in ops and "SkipLayerNormalization" not in ops
    dumped = tmp_path / "optimized.onnx"
    _open(exported.model("int8"), EncoderSettings(), optimized_to=dumped)
    assert "SkipLayerNormalization" not in {n.op_type for n in onnx.load(str(dumped)).graph.node}
    fused = tmp_path / "fused.onnx"  # what `python -m benchmarks encoder` times against it
    _open(exported.model("int8"), EncoderSettings(skip_layer_norm=True), optimized_to=fused)
    assert "SkipLayerNormalization" in {n.op_type for n in onnx.load(str(fused)).graph.node}


def test_second_export_is_a_noop(exported: Artifacts, cache_root: Path) -> None:
    before = exported.manifest_path.stat().st_mtime_ns
    again, built = ensure_exported(cache_root=cache_root)
    assert not built
    assert again.root == exported.root
    assert exported.manifest_path.stat().st_mtime_ns == before
    assert locate(cache_root=cache_root) == exported


def test_changed_source_is_exported_again(exported: Artifacts, cache_root: Path, tmp_path: Path) -> None:
    src = tmp_path / "model"
    shutil.copytree(source_dir(), src, copy_function=os.symlink)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps({**config, "triage_test_marker": 1}))
    changed, built = ensure_exported(source=src, cache_root=cache_root)
    assert built
    assert changed.root != exported.root and changed.complete()
    assert exported.complete()  # the other export stays
    assert changed.manifest()["source_sha256"] != exported.manifest()["source_sha256"]
    assert ensure_exported(source=src, cache_root=cache_root) == (changed, False)


def test_fewer_layers_are_an_export_of_their_own(exported: Artifacts, cache_root: Path, int8: Encoder) -> None:
    three, built = ensure_exported(settings=ExportSettings(layers=3), cache_root=cache_root)
    assert built and three.root != exported.root and three.manifest()["layers"] == 3
    assert exported.manifest()["layers"] == 6 and three.manifest()["min_cosine_vs_pytorch"]["fp32"] > 0.999
    short = Encoder.load(EncoderSettings(precision="int8"), artifacts=three)
    a, b = short.embed(TEXTS[:3]), int8.embed(TEXTS[:3])
    assert a.shape == b.shape and cosines(a, b).max() < 0.99  # another embedding: its heads are trained apart
    # the guard reads layer 3 of the full model: the very embedding of the 3-layer export (fp32)
    full = Encoder.load(EncoderSettings(precision="fp32"), artifacts=exported)
    three_fp32 = Encoder.load(EncoderSettings(precision="fp32"), artifacts=three)
    shallow = np.stack([r.shallow for r in full.read(TEXTS)])
    np.testing.assert_allclose(shallow, three_fp32.embed(TEXTS), atol=2e-4)
    with pytest.raises(NotReady, match="has 6 layers; cannot keep 7"):
        ensure_exported(settings=ExportSettings(layers=7), cache_root=cache_root)


@pytest.mark.model
def test_missing_export_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(NotReady, match=r"python -m classifiers\.training\.export"):
        Encoder.load(cache_root=tmp_path)


def test_serving_never_imports_torch(exported: Artifacts, cache_root: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from classifiers.encoder import Encoder\n"
        "import classifiers.batching, classifiers.training.export\n"
        f"e = Encoder.load(cache_root=Path({str(cache_root)!r}))\n"
        "assert e.embed_one('hello').shape == (384,)\n"
        "bad = [m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_empty_and_broken_text(int8: Encoder) -> None:
    assert int8.encode("").ids == [101, 102]
    surrogates = b"route me \xff\xfe now".decode("utf-8", errors="surrogateescape")
    rows = int8.embed(["", surrogates, b"raw \xff bytes", "\x00\u200b"])
    assert np.isfinite(rows).all()
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-4)


def test_huge_prompt_keeps_head_and_tail(int8: Encoder) -> None:
    text = "alpha " + "filler " * 100_000 + "omega"
    enc = int8.encode(text)
    assert enc.truncated and enc.original_tokens > 256
    assert len(enc.ids) == 256
    vocab = {w: int8.encode(w).ids[1] for w in ("alpha", "filler", "omega")}
    assert enc.ids[1] == vocab["alpha"] and enc.ids[-2] == vocab["omega"]
    assert enc.ids[1 + 127] == vocab["filler"] and len(enc.ids[1:-1]) == 254
    assert int8.embed_one(text).shape == (384,)


def test_short_prompt_is_not_truncated(int8: Encoder) -> None:
    enc = int8.encode("one two three")
    assert not enc.truncated and enc.original_tokens == len(enc.ids) == 5


def test_settings_are_checked(exported: Artifacts) -> None:
    with pytest.raises(InvalidRequest):
        EncoderSettings(precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        EncoderSettings(intra_op_threads=0)
    with pytest.raises(InvalidRequest, match="rows"):
        EncoderSettings(rows="sideways")  # type: ignore[arg-type]
    with pytest.raises(NotReady, match="provider"):
        Encoder.load(EncoderSettings(provider="NoSuchExecutionProvider"), artifacts=exported)


def test_batch_equals_single_calls(fp32: Encoder, int8: Encoder, exported: Artifacts) -> None:
    singles = np.stack([fp32.embed_one(t) for t in TEXTS])
    np.testing.assert_allclose(fp32.embed(TEXTS), singles, atol=1e-5)
    # int8 keeps rows apart by default: a prompt's embedding is exactly the same whatever its batch
    assert int8.settings.apart
    alone = np.stack([int8.embed_one(t) for t in TEXTS])
    np.testing.assert_array_equal(int8.embed(TEXTS), alone)
    np.testing.assert_array_equal(int8.embed([TEXTS[3], TEXTS[0]])[1], alone[0])
    # on two threads the rows are spread over two 1-thread sessions: still each prompt alone
    lanes = Encoder.load(EncoderSettings(precision="int8", intra_op_threads=2), artifacts=exported)
    np.testing.assert_array_equal(lanes.embed(TEXTS), alone)
    # one padded forward: activations quantized per tensor, so a row depends (a little) on its neighbours
    together = Encoder.load(EncoderSettings(precision="int8", rows="together"), artifacts=exported)
    assert_twins(together.embed(TEXTS), alone)
    assert not np.array_equal(together.embed(TEXTS), alone)


def test_micro_batcher_matches_single_calls_in_order(fp32: Encoder) -> None:
    texts = [f"{t} #{i}" for i, t in enumerate(TEXTS * 5)]
    singles = np.stack([fp32.embed_one(t) for t in texts])

    async def go() -> tuple[list[np.ndarray], int]:
        async with MicroBatcher(fp32.embed, max_batch=8, max_wait_ms=5.0) as batcher:
            rows = await asyncio.gather(*(batcher.embed(t) for t in texts))
            return rows, batcher.stats.batches

    rows, batches = asyncio.run(go())
    np.testing.assert_allclose(np.stack(rows), singles, atol=1e-5)
    assert batches <= len(texts) // 2


def test_micro_batcher_runs_off_the_loop_and_propagates_errors() -> None:
    threads: list[int] = []

    def forward(texts: Sequence[str]) -> np.ndarray:
        threads.append(threading.get_ident())
        if any("boom" in t for t in texts):
            raise ValueError("boom")
        return np.array([[float(len(t))] for t in texts], dtype=np.float32)

    async def go() -> tuple[list[np.ndarray | BaseException], np.ndarray, int]:
        loop_thread = threading.get_ident()
        async with MicroBatcher(forward, max_batch=4, max_wait_ms=20.0) as batcher:
            first = await asyncio.gather(*(batcher.embed(t) for t in ("a", "boom", "ccc")), return_exceptions=True)
            after = await batcher.embed("dddd")
        return first, after, loop_thread

    first, after, loop_thread = asyncio.run(go())
    assert all(isinstance(r, ValueError) for r in first)
    assert after.tolist() == [4.0]
    assert threads and loop_thread not in threads


def test_micro_batcher_close_drains_then_refuses() -> None:
    calls: list[int] = []

    def forward(texts: Sequence[str]) -> np.ndarray:
        calls.append(len(texts))
        return np.zeros((len(texts), 1), dtype=np.float32)

    async def go() -> list[np.ndarray]:
        batcher: MicroBatcher[str, np.ndarray] = MicroBatcher(forward, max_batch=2, max_wait_ms=50.0)
        pending = [asyncio.ensure_future(batcher.embed(str(i))) for i in range(5)]
        await asyncio.sleep(0)
        await batcher.aclose()
        with pytest.raises(NotReady):
            await batcher.embed("late")
        return await asyncio.gather(*pending)

    rows = asyncio.run(go())
    assert len(rows) == 5 and sum(calls) == 5 and max(calls) <= 2


def test_micro_batcher_drops_cancelled_waiters() -> None:
    seen: list[str] = []

    def forward(texts: Sequence[str]) -> np.ndarray:
        seen.extend(texts)
        return np.zeros((len(texts), 1), dtype=np.float32)

    async def go() -> None:
        async with MicroBatcher(forward, max_batch=8, max_wait_ms=30.0) as batcher:
            gone = asyncio.ensure_future(batcher.embed("gone"))
            kept = asyncio.ensure_future(batcher.embed("kept"))
            await asyncio.sleep(0)
            gone.cancel()
            await kept

    asyncio.run(go())
    assert seen == ["kept"]


def test_micro_batcher_settings_are_checked() -> None:
    with pytest.raises(InvalidRequest):
        MicroBatcher(lambda texts: np.zeros((0, 1)), max_batch=0)


def test_the_bench_floor_is_the_exports_own_products(exported: Artifacts, tmp_path: Path) -> None:
    """`python -m benchmarks encoder`'s floor row runs every projection of the export (4 per layer, its own
    weights) and nothing else; in fp32 the chain computes exactly those products."""
    import onnxruntime as ort

    from benchmarks.encoder_floor import chain_model, floor_contestant, layer_weights

    weights = layer_weights(exported.model("fp32"))
    assert [w.shape for w in weights[:4]] == [(384, 1152), (384, 384), (384, 1536), (1536, 384)]
    assert len(weights) == 4 * exported.manifest()["layers"]
    x = np.random.default_rng(1).standard_normal((7, 384)).astype(np.float32)
    session = ort.InferenceSession(
        str(chain_model(weights, tmp_path / "chain.onnx")), providers=["CPUExecutionProvider"]
    )
    final, *qkv = session.run(None, {"x": x})
    expected, projections = x, []
    for layer in range(len(weights) // 4):
        qkv_w, out_w, up_w, down_w = weights[4 * layer : 4 * layer + 4]
        projections.append(expected @ qkv_w)
        expected = expected @ out_w @ up_w @ down_w
    np.testing.assert_allclose(final, expected, rtol=1e-3, atol=1e-3 * float(np.abs(expected).max()))
    assert [p.shape for p in qkv] == [p.shape for p in projections]
    probe = Encoder.load(EncoderSettings(), artifacts=exported)
    floor = floor_contestant(exported, probe)
    assert floor.forwards[1](["a short prompt", "and another one"]).shape == (2, 384)
