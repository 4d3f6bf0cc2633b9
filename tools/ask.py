#!/usr/bin/env python
"""Ask a chat model one question with plain transformers (greedy): ``python tools/ask.py MODEL_DIR "question"``."""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def ask(model_dir: str, question: str, max_new_tokens: int = 32) -> str:
    """The model's greedy answer to ``question`` as one user turn of its chat template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    messages = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"Q: {sys.argv[2]}\nA: {ask(sys.argv[1], sys.argv[2])}")
