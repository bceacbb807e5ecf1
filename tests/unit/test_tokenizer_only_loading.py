"""load_tokenizer: the router's tokenizer without the model's config and
without torch, from the GGUF's converted folder when there is one and through
a child process when there is none; the same tokens and chat template as the
engines' tokenizer either way."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.engine.loader import load_model_info

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The capital of France is", " leading space and émoji 🦀", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]

# Prints what the router would tokenize with, and whether torch came along.
PROBE = f"""
import json, sys
from tandem.engine.loader import load_tokenizer
loaded = load_tokenizer("smollm2")
tok = loaded.tokenizer
print(json.dumps({{"torch": "torch" in sys.modules, "model_id": loaded.model_id, "size": len(tok),
                  "ids": [tok.encode(t) for t in {TEXTS!r}],
                  "chat": tok.apply_chat_template({CHAT!r}, add_generation_prompt=True, tokenize=False)}}))
"""


@pytest.fixture(scope="module")
def engines_tokenizer():
    # Also makes sure the embedded GGUF's converted folder exists in the cache.
    return load_model_info("smollm2")


@pytest.mark.parametrize("cache", ["converted folder", "no cache"])
def test_the_router_tokenizer_is_the_engines_and_loads_no_torch(engines_tokenizer, cache):
    env = dict(os.environ)
    if cache == "no cache":
        env["TANDEM_GGUF_CACHE"] = "0"  # the child-process path: the GGUF read elsewhere
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    tok = engines_tokenizer.tokenizer
    assert got["torch"] is False
    assert got["model_id"] == engines_tokenizer.model_id and got["size"] == len(tok)
    assert got["ids"] == [tok.encode(t) for t in TEXTS]
    assert got["chat"] == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_a_model_folder_without_a_tokenizer_is_an_error_that_says_to_give_one(tmp_path):
    from tandem.engine.loader import ModelNotFoundError, load_tokenizer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="--tokenizer"):
        load_tokenizer(str(tmp_path))
