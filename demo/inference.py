"""Stage 5's model side: load a Hugging Face model directory, answer prompts greedily, and
score the answers against the validation responses.

Used by the demo on the model it downloaded from S3, and by tests/demo/test_demo_answers.py
on a model trained locally with the demo's settings (the same code, so the test checks what
the demo shows)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Answer:
    prompt: str
    expected: str
    base: str
    fine_tuned: str
    correct: bool  # the fine-tuned answer is the expected one, as the tokenizer writes it


def load(path: Path) -> tuple[Any, Any]:
    """(tokenizer, model in eval mode), as a user loads the exported model."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def generate(tok, model, prompt: str, max_new_tokens: int = 16) -> str:
    """The greedy answer to one user turn, through the tokenizer's chat template."""
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def response_loss(tok, model, rows: list[dict[str, str]]) -> float:
    """Mean loss on the responses of prompt/response rows (the tokens a job trains on)."""
    import torch

    total = count = 0.0
    for row in rows:
        user = [{"role": "user", "content": row["prompt"]}]
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(user + [{"role": "assistant", "content": row["response"]}], tokenize=False)
        ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        labels = ids.clone()
        labels[:, :n_prompt] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss.item()
        n = int((labels[:, 1:] != -100).sum())
        total, count = total + loss * n, count + n
    return total / max(count, 1)


def as_generated(tok, text: str) -> str:
    """``text`` as the tokenizer decodes it (the data's "green ." comes back as "green.")."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True).strip()


def answers(base: tuple[Any, Any], tuned: tuple[Any, Any], rows: list[dict[str, str]]) -> list[Answer]:
    """Each row's prompt answered by the base and the fine-tuned model."""
    out = []
    for r in rows:
        t = generate(*tuned, r["prompt"])
        out.append(Answer(r["prompt"], r["response"], generate(*base, r["prompt"]), t,
                          correct=t == as_generated(tuned[0], r["response"])))
    return out
