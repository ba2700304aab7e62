"""Turn a packaged GGUF model into the Hugging Face folder vLLM loads (run in vLLM's own venv).

vLLM's CPU build wants safetensors weights and a tokenizer, not GGUF. transformers (with ``gguf``)
dequantizes the GGUF's tensors; the model is rebuilt from its config without the GGUF's
``quantization_config``, so it saves as plain bfloat16 safetensors, with the tokenizer and its
chat template beside it. The folder records the GGUF's SHA-256 (``source.sha256``): a second run
on the same file does nothing, a changed file is converted again.

    .venv-vllm/bin/python benchmarks/vllm_convert.py MODEL.gguf OUT_DIR

This file imports nothing of triage: it runs under vLLM's interpreter, not the gateway's.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from pathlib import Path

# run as a script, its folder would come first on the path, and its neighbours (profile.py) would
# shadow the standard library's modules for torch
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

STAMP = "source.sha256"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert(gguf: Path, out: Path) -> bool:
    """Convert ``gguf`` into ``out`` unless it already holds this file's conversion; True if it ran."""
    digest = sha256(gguf)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return False
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]  # tied to the embeddings
    if missing or result.unexpected_keys:
        raise SystemExit(f"{gguf}: weights do not match the config: {missing[:5]} {result.unexpected_keys[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(digest + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    gguf, out = Path(argv[0]), Path(argv[1])
    if not gguf.is_file():
        print(f"no GGUF file at {gguf}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    ran = convert(gguf, out)
    print(f"{out}: {'converted' if ran else 'up to date'} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
