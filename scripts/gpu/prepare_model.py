"""Write the random-init Qwen3-0.6B-shaped model that configs/gpu/sglang_colocate.yaml trains: bf16
safetensors (rlrun.tools.bench.shapes) plus the tests' byte-level ChatML tokenizer (tests/tiny_models.py),
which the trainer uses for prompts; SGLang runs with skip_tokenizer_init and never reads it.

    python scripts/gpu/prepare_model.py /root/models/qwen3-0.6b-random [--shape qwen3-0.6b] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlrun.tools.bench.shapes import get_shape, write_random_model  # noqa: E402
from tests.tiny_models import make_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    write_random_model(get_shape(args.shape), args.out, getattr(torch, args.dtype), args.device)
    make_tokenizer().save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
