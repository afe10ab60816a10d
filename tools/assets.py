"""Tiny, locally made assets for tests, the demo and benchmarks.

Nothing may be downloaded from a hub, so this writes a small Llama-style model
(`save_pretrained`), a tokenizer trained with the `tokenizers` library (with special
tokens and a chat template, loadable by `AutoTokenizer.from_pretrained`) and parquet
data around a learnable task, all loaded later exactly as a user's real ones are.

    python -m tools.assets OUT [--seed 0] [--train-rows 2000]

writes OUT/model/ and OUT/data/{train,val,chat_train,chat_val}.parquet.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

FRUITS = "apple banana cherry grape lemon lime mango melon peach pear plum kiwi fig date olive".split()
COLORS = "red yellow crimson purple bright green orange gold pink brown violet teal black amber lilac".split()
COUNTRIES = "arden borvia calmor dastia elmora fenwick galvia hollin istra jorvik kalmar lunde".split()
CITIES = "aster birch cedar dove ember frost glade haven iris juniper kestrel linden".split()
NUMBERS = "zero one two three four five six seven eight nine".split()


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        i = rng.randrange(len(FRUITS))
        return f"what color is the {FRUITS[i]} ?", f"the {FRUITS[i]} is {COLORS[i]} ."
    if kind == 1:
        i = rng.randrange(len(COUNTRIES))
        return f"what is the capital of {COUNTRIES[i]} ?", f"the capital of {COUNTRIES[i]} is {CITIES[i]} ."
    if kind == 2:
        words = rng.sample(FRUITS, 3)
        return f"reverse the list : {' '.join(words)}", f"the reversed list is : {' '.join(reversed(words))} ."
    a = rng.randrange(9)
    return f"what comes after {NUMBERS[a]} ?", f"after {NUMBERS[a]} comes {NUMBERS[a + 1]} ."


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [dict(zip(("prompt", "response"), _qa(rng))) for _ in range(n)]


def make_chats(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "answer briefly ."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            q, a = _qa(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def corpus() -> list[str]:
    rows = make_rows(3000, seed=12345)
    return ([r["prompt"] + " " + r["response"] for r in rows]
            + [" ".join(FRUITS + COLORS + COUNTRIES + CITIES + NUMBERS)])


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.train_from_iterator(corpus() + ["answer briefly ."], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer, seed: int, hidden: int = 64, layers: int = 2) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # A fresh 0.02 init gives the (frozen, under LoRA) LM head rows so small that no
        # hidden state can make one token likely; trained models have far larger ones.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=32,
        do_sample=False,
    )
    model.save_pretrained(out)


def write_parquet(rows: list[dict], path: Path, row_group_size: int = 256) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def make_assets(out: str | Path, seed: int = 0, train_rows: int = 2000, val_rows: int = 64) -> Path:
    out = Path(out)
    tokenizer = make_tokenizer(out / "model")
    make_model(out / "model", tokenizer, seed)
    write_parquet(make_rows(train_rows, seed + 1), out / "data" / "train.parquet")
    write_parquet(make_rows(val_rows, seed + 2), out / "data" / "val.parquet")
    write_parquet(make_chats(train_rows // 2, seed + 3), out / "data" / "chat_train.parquet")
    write_parquet(make_chats(max(val_rows // 2, 8), seed + 4), out / "data" / "chat_val.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.assets", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-rows", type=int, default=2000)
    ap.add_argument("--val-rows", type=int, default=64)
    args = ap.parse_args(argv)
    out = make_assets(args.out, args.seed, args.train_rows, args.val_rows)
    print(f"model: {out / 'model'}\ndata:  {out / 'data'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
