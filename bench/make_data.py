#!/usr/bin/env python
"""Deterministic synthetic SFT dataset + tiny word-level tokenizer.

Writes (default --out .bench/data):
  train.parquet   columns: prompt (str), response (str), prompt_ids (list<int32>), response_ids (list<int32>)
                  prompt_ids   = [<s>, <|user|>, w_1..w_P, <|assistant|>]   (== chat template of `prompt`)
                  response_ids = [w_1..w_R, </s>]                         (== tokenizer(response + eos))
                  input_ids = prompt_ids + response_ids; loss only on response_ids.
  tokenizer/      a PreTrainedTokenizerFast (WordLevel, 8192 ids, whitespace split) with a chat template,
                  so text-based trainers (verl SFTDataset, TRL) reproduce exactly the same ids.
  stats.json      length statistics + sha256 of the id columns (to check reproducibility).

Lengths are variable: content lengths are lognormal (prompt mean ~100, response mean ~150 tokens,
sigma 0.6), total sequence capped at --max-len (512) by truncating the response (EOS kept).
Tokens: Zipf(1.1) unigrams over the 8186 word ids mixed 50/50 with a fixed random "successor" table,
so the data has a little learnable structure (loss falls below the unigram entropy over time).
The examples are i.i.d., so reading the file in order is already a random order: every contender
reads it sequentially (no sampler shuffling), and therefore sees identical batches.
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

VOCAB = 8192
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<unk>"]  # ids 0..5
N_SPECIAL = len(SPECIALS)
PAD, BOS, EOS, USER, ASSISTANT, UNK = range(N_SPECIAL)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_words(n: int, rng: np.random.Generator) -> list:
    """n distinct pronounceable pseudo-words (deterministic)."""
    cons = list("bcdfghjklmnprstvwz")
    vows = list("aeiou")
    syl = [c + v for c in cons for v in vows]  # 90 syllables
    words, seen = [], set()
    while len(words) < n:
        k = int(rng.integers(1, 4))
        w = "".join(syl[int(i)] for i in rng.integers(0, len(syl), size=k))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def lognormal_len(rng, mean, sigma, lo):
    mu = np.log(mean) - sigma**2 / 2.0
    return max(lo, int(round(rng.lognormal(mu, sigma))))


def sample_tokens(rng, n, zipf_p, succ):
    out = np.empty(n, dtype=np.int64)
    nw = len(zipf_p)
    prev = None
    for i in range(n):
        if prev is not None and rng.random() < 0.5:
            tok = succ[prev]
        else:
            tok = int(rng.choice(nw, p=zipf_p))
        out[i] = tok
        prev = tok
    return out + N_SPECIAL  # word ids live in [N_SPECIAL, VOCAB)


def build_tokenizer(words, out_dir: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i, w in enumerate(words):
        vocab[w] = N_SPECIAL + i
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # Rewrite tokenizer_config.json in a form both transformers 4.x (e.g. verl's env) and 5.x load.
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "additional_special_tokens": ["<|user|>", "<|assistant|>"],
                "model_max_length": 1024,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    (out_dir / "special_tokens_map.json").unlink(missing_ok=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / ".bench" / "data"))
    ap.add_argument("-n", "--num-examples", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompt-mean", type=float, default=100.0)
    ap.add_argument("--response-mean", type=float, default=150.0)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    nw = VOCAB - N_SPECIAL
    words = make_words(nw, rng)
    ranks = np.arange(1, nw + 1, dtype=np.float64)
    zipf_p = ranks**-1.1
    zipf_p /= zipf_p.sum()
    succ = rng.permutation(nw)  # fixed successor table (word index -> word index)

    rows = {"prompt": [], "response": [], "prompt_ids": [], "response_ids": []}
    for _ in range(args.num_examples):
        p_len = lognormal_len(rng, args.prompt_mean, args.sigma, 4)
        r_len = lognormal_len(rng, args.response_mean, args.sigma, 4)
        p_len = min(p_len, args.max_len - 3 - 1 - 4)  # leave room for specials + >=4 response tokens
        r_len = min(r_len, args.max_len - (p_len + 3) - 1)
        p = sample_tokens(rng, p_len, zipf_p, succ)
        r = sample_tokens(rng, r_len, zipf_p, succ)
        rows["prompt"].append(" ".join(words[i - N_SPECIAL] for i in p))
        rows["response"].append(" ".join(words[i - N_SPECIAL] for i in r))
        rows["prompt_ids"].append([BOS, USER] + p.tolist() + [ASSISTANT])
        rows["response_ids"].append(r.tolist() + [EOS])

    table = pa.table(
        {
            "prompt": pa.array(rows["prompt"], pa.string()),
            "response": pa.array(rows["response"], pa.string()),
            "prompt_ids": pa.array(rows["prompt_ids"], pa.list_(pa.int32())),
            "response_ids": pa.array(rows["response_ids"], pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, out / "train.parquet")

    tok = build_tokenizer(words, out / "tokenizer")
    # Verify the text path reproduces the ids exactly (what text-based trainers will see).
    for i in range(args.num_examples):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": rows["prompt"][i]}], add_generation_prompt=True, tokenize=False
        )
        pid = tok(chat, add_special_tokens=False)["input_ids"]
        rid = tok(rows["response"][i] + tok.eos_token, add_special_tokens=False)["input_ids"]
        assert pid == rows["prompt_ids"][i], (i, pid[:8], rows["prompt_ids"][i][:8])
        assert rid == rows["response_ids"][i], i

    pl = np.array([len(x) for x in rows["prompt_ids"]])
    rl = np.array([len(x) for x in rows["response_ids"]])
    tl = pl + rl
    h = hashlib.sha256()
    for a, b in zip(rows["prompt_ids"], rows["response_ids"]):
        h.update(np.asarray(a, np.int32).tobytes() + b"|" + np.asarray(b, np.int32).tobytes() + b"\n")
    stats = {
        "num_examples": args.num_examples,
        "seed": args.seed,
        "prompt_len": {"mean": float(pl.mean()), "p50": float(np.median(pl)), "max": int(pl.max())},
        "response_len": {"mean": float(rl.mean()), "p50": float(np.median(rl)), "max": int(rl.max())},
        "total_len": {
            "mean": float(tl.mean()),
            "p50": float(np.median(tl)),
            "p90": float(np.percentile(tl, 90)),
            "min": int(tl.min()),
            "max": int(tl.max()),
        },
        "total_tokens": int(tl.sum()),
        "loss_tokens": int(rl.sum()),
        "ids_sha256": h.hexdigest(),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
