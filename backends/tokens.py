"""Prompt tokens for grouping a batch: the target model's own tokenizer where one is known.

A model served from a GGUF (``llamacpp``, ``gguf_scorer``) is tokenized by that file's vocabulary
(llama.cpp, ``vocab_only``: no weights); any model may name a HuggingFace ``tokenizer.json``
(``models.NAME.tokenizer``, relative to the policy file) for a remote vLLM/SGLang engine. Every
other model (and ``batches.tokens: approx``) gets :func:`backends.prefix.approx_tokens`.

Cost. A batch shares long prefixes (few-shot templates), so :func:`tokenize_batch` tokenizes each
shared prefix once: the texts are sorted, every text is cut where it stops sharing with its
sorted neighbours, backed off to the start of a run of spaces, and the pieces are tokenized apart
and concatenated. A pre-tokenizer that always splits a word from the spaces after it (GPT-2-style
byte-level BPE, BERT's WordPiece) gives the same tokens either way: on 6,511 BBH prompts the
vocabularies of SmolLM2 and Gemma 3 (llama.cpp) and MiniLM's tokenizer.json gave every prompt the
same tokens. A tokenizer that does not (one that puts a space before every text: SentencePiece with
a dummy prefix) is caught on probe texts when loaded, and then tokenizes every text whole.

Each list of tokens starts with a pseudo-token, the CRC-32 of the model's name, so requests for
different models (incomparable tokens, different engines) never share a prefix. Loading a
tokenizer reads a file: call :func:`batch_tokens` from a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from backends import gguf
from backends.prefix import approx_tokens, common_prefix_len, prompt_text
from policies.errors import ModelNotFound, PolicyInvalid
from policies.plans import ChainPlan, resolve
from policies.schema import GGUFScorerBackendSpec, LlamaCppBackendSpec, Policy
from policies.tiers import ScorerTier

Tokenize = Callable[[str], Sequence[int]]

MIN_CUT = 64  # characters: a shorter shared prefix is not worth a tokenizer call of its own
# pieces that must tokenize the same apart as together, for the prefix cache to be used
_PROBES = (
    "Q: Which sentence is true?\nOptions:\n(A) It's 12345 m.  (B) Naïve café, «ok»!\nA: Let's think: (B).",
    '<start> The answer is: yes.\n\n\tNext   question , "quoted" ... 3.14 == x_1',
)


@dataclass(frozen=True)
class Tokenizer:
    tokenize: Tokenize
    name: str  # what it is, for the batch's description: "gguf:FILE", "json:FILE"
    splits_at_spaces: bool  # pieces cut before a space tokenize as the whole: the prefix cache is exact


_lock = threading.Lock()
_loaded: dict[tuple[str, str, int, int], Tokenizer] = {}  # (kind, path, mtime_ns, size)


def tokenizer_for(policy: Policy, model: str, base_dir: Path = Path(".")) -> Tokenizer | None:
    """The tokenizer of ``model`` (a model, an alias: its first target), loaded once per file; None
    when none is known (a semantic or cascade virtual model: the served model is not known yet).
    A ``tokenizer.json`` that cannot be loaded raises :class:`PolicyInvalid` naming the field."""
    try:
        plan = resolve(policy, model)
    except ModelNotFound:
        return None
    if not isinstance(plan, ChainPlan):
        return None  # decided per request: the served model is not known yet
    spec = policy.models[plan.chain[0]]
    if (path := spec.tokenizer_file(base_dir)) is not None:
        return _load("json", path, f"models.{model}.tokenizer")
    return _gguf_tokenizer(policy, spec.backend, f"models.{model}.backend")


def decide_tokenizer(policy: Policy) -> Tokenizer | None:
    """For ``/v1/decide``: the GGUF of the cascade's first scorer tier (the tier that keeps a prefix)."""
    tiers = policy.cascade.tiers if policy.cascade is not None else []
    scorer = next((t for t in tiers if isinstance(t, ScorerTier)), None)
    return None if scorer is None else _gguf_tokenizer(policy, scorer.backend, f"backends.{scorer.backend}")


def _gguf_tokenizer(policy: Policy, backend: str, where: str) -> Tokenizer | None:
    spec = policy.backends.get(backend)
    if not isinstance(spec, LlamaCppBackendSpec | GGUFScorerBackendSpec):
        return None
    src = spec.gguf
    return _load("gguf", _package_gguf(src.package) if src.package else gguf.model_file(None, src.path), where)


@functools.cache
def _package_gguf(package: str) -> Path:
    """A packaged GGUF's path, found once (finding Gemma's re-checks the sha256 of 250 MB)."""
    return gguf.model_file(package, None)


def load(path: Path, where: str = "tokenizer") -> Tokenizer:
    """A GGUF file's vocabulary (``.gguf``) or a ``tokenizer.json``, loaded once per file version;
    :class:`PolicyInvalid` (prefixed with ``where``) if it cannot be read."""
    return _load("gguf" if path.suffix == ".gguf" else "json", path, where)


def _load(kind: str, path: Path, where: str) -> Tokenizer:
    try:
        st = path.stat()
    except OSError as exc:
        raise PolicyInvalid([f"{where}: cannot read {path}: {exc.strerror or exc}"]) from None
    key = (kind, str(path.resolve()), st.st_mtime_ns, st.st_size)
    with _lock:  # one load per file, even with two batches starting at once
        tok = _loaded.get(key)
        if tok is None:
            fn = _GGUFVocab(path, where) if kind == "gguf" else _hf_tokenizer(path, where)
            for old in [k for k in _loaded if k[:2] == key[:2]]:  # the file changed: drop the old one
                del _loaded[old]
            tok = _loaded[key] = Tokenizer(fn, f"{kind}:{path.name}", _splits_at_spaces(fn))
    return dataclasses.replace(tok, name=f"{kind}:{path.name}")  # the name it was asked by (links share one)


class _GGUFVocab:
    """llama.cpp's tokenizer of a GGUF file, loaded without the weights (``vocab_only``)."""

    def __init__(self, path: Path, where: str) -> None:
        import llama_cpp

        try:
            self._llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except ValueError as exc:  # llama-cpp-python: "Failed to load model from file"
            raise PolicyInvalid([f"{where}: cannot load the vocabulary of {path}: {exc}"]) from None
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        # closed before the interpreter tears llama_cpp down (its __del__ then fails noisily)
        atexit.register(self._llm.close)
        self._tokenize, self._token = llama_cpp.llama_tokenize, llama_cpp.llama_token

    def __call__(self, text: str) -> list[int]:
        # llama.cpp directly: Llama.tokenize sizes its buffer by the training context, 0 without the
        # weights, so it would tokenize every text twice. No BOS, no special tokens parsed.
        data = text.encode("utf-8", "replace")
        size = len(data) + 8
        while True:
            buf = (self._token * size)()
            n = self._tokenize(self._vocab, data, len(data), buf, size, False, False)
            if n >= 0:
                return buf[:n]
            size = -n


def _hf_tokenizer(path: Path, where: str) -> Tokenize:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for any bad file
        raise PolicyInvalid([f"{where}: {path} is not a tokenizers tokenizer.json: {exc}"]) from None
    tok.no_truncation()
    tok.no_padding()
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _splits_at_spaces(tokenize: Tokenize) -> bool:
    """Whether every piece of the probes cut at :func:`_cuts` tokenizes as the whole does."""
    for text in _PROBES:
        whole = list(tokenize(text))
        for cut in _cuts(text):
            if [*tokenize(text[:cut]), *tokenize(text[cut:])] != whole:
                return False
    return True


def _cuts(text: str) -> list[int]:
    """Every place where a run of spaces starts after a character that is not whitespace."""
    return [i for i in range(1, len(text)) if text[i] == " " and not text[i - 1].isspace()]


def _cut(text: str, shared: int) -> int:
    """The last place before ``shared`` where a run of spaces starts after a character that is not
    whitespace (``text[cut]`` is then shared as well); 0 if none."""
    i = text.rfind(" ", 0, shared)
    while i > 0 and text[i - 1].isspace():
        i = text.rfind(" ", 0, i)
    return max(i, 0)


def tokenize_batch(texts: Sequence[str], tokenize: Tokenize, *, prefix_cache: bool = True) -> list[tuple[int, ...]]:
    """Every text's tokens; with ``prefix_cache``, the prefix a text shares with its sorted
    neighbours is tokenized once for all of them (exact when the tokenizer splits at spaces: see
    :attr:`Tokenizer.splits_at_spaces`)."""
    if not prefix_cache:
        return [tuple(tokenize(t)) for t in texts]
    order = sorted(range(len(texts)), key=texts.__getitem__)
    shared = [0, *(common_prefix_len(texts[a], texts[b]) for a, b in pairwise(order)), 0]
    out: list[tuple[int, ...]] = [()] * len(texts)
    stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]  # (cut, tokens of text[:cut]), prefixes of the text
    for pos, i in enumerate(order):
        text = texts[i]
        while stack[-1][0] and stack[-1][0] >= shared[pos]:  # text[cut] is not shared with the previous text
            stack.pop()
        at, tokens = stack[-1]
        cut = _cut(text, shared[pos + 1])  # kept for the next text
        if cut - at >= MIN_CUT:
            tokens = (*tokens, *tokenize(text[at:cut]))
            stack.append((cut, tokens))
            at = cut
        out[i] = (*tokens, *tokenize(text[at:]))
    return out


def pseudo_token(model: str) -> int:
    """The first token of every prompt for ``model``: requests for two models never share a prefix."""
    return zlib.crc32(model.encode("utf-8"))


def batch_tokens(
    policy: Policy,
    bodies: Sequence[Mapping[str, Any]],
    base_dir: Path = Path("."),
    *,
    tokens: Literal["model", "approx"] | None = None,
    prefix_cache: bool = True,
) -> tuple[list[tuple[int, ...]], str]:
    """Tokens of each request body's prompt (:func:`backends.prefix.prompt_text`), each list led by
    its model's pseudo-token, and what tokenized them (``"smollm2=gguf:FILE, auto=approx"``).

    ``batches.tokens: model``: each model's tokenizer (:func:`tokenizer_for`; a body without a
    model, ``/v1/decide``: :func:`decide_tokenizer`), :func:`approx_tokens` where none is known;
    ``approx``: approx_tokens for all; ``tokens`` overrides the setting. Relative tokenizer paths
    are taken from ``base_dir`` (the policy file's folder). Blocking (loads tokenizers on first
    use): run it in a worker thread. Raises :class:`PolicyInvalid` when a tokenizer the policy
    names cannot be loaded (``tokens="approx"`` then still works)."""
    by_model: dict[str, list[int]] = {}
    for i, body in enumerate(bodies):
        by_model.setdefault(str(body.get("model") or ""), []).append(i)
    out: list[tuple[int, ...]] = [()] * len(bodies)
    used: list[str] = []
    for model, ix in sorted(by_model.items()):
        tok = None
        if (tokens or policy.batches.tokens) == "model":
            tok = tokenizer_for(policy, model, base_dir) if model else decide_tokenizer(policy)
        texts = [prompt_text(bodies[i]) for i in ix]
        if tok is None:
            lists = [approx_tokens(t) for t in texts]
        else:
            lists = tokenize_batch(texts, tok.tokenize, prefix_cache=prefix_cache and tok.splits_at_spaces)
        lead = (pseudo_token(model),)
        for i, toks in zip(ix, lists, strict=True):
            out[i] = lead + toks
        used.append(f"{model or '/v1/decide'}={'approx' if tok is None else tok.name}")
    return out, ", ".join(used)
