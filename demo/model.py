"""Stage 5: download the exported model from status.output.uri with the trainer's own S3
client, load it with transformers as a user would, and answer the validation prompts next
to the base model (demo.inference)."""
from __future__ import annotations

import shutil
from dataclasses import asdict

from sftjob_trainer.storage import S3Prefix

from demo import inference
from demo.context import Ctx, shown, status

SHOWN_PROMPTS = 3  # the first validation rows, printed with both models' answers


def download(uri: str, dest) -> list[str]:
    """Every object under the s3:// prefix ``uri`` into ``dest`` (emptied first); the file names."""
    if dest.exists():
        shutil.rmtree(dest)
    parent, _, leaf = uri.rstrip("/").rpartition("/")
    S3Prefix(parent).download_dir(leaf, dest)
    return sorted(p.name for p in dest.iterdir())


def stage_model(ctx: Ctx, job: dict) -> None:
    import pyarrow.parquet as pq
    import torch

    out, a = ctx.out, ctx.args
    uri = status(job)["output"]["uri"]
    out.stage(5, "Downloading the fine-tuned model from S3, loading it with transformers, generating")
    dest = a.workdir / "model"
    names = download(uri, dest)
    out.say(f"status.output.uri = {uri}")
    out.say(f"downloaded to {shown(dest)}: " + ", ".join(names))

    torch.set_num_threads(1)
    rows = pq.read_table(ctx.assets / "data" / "val.parquet").to_pylist()
    tuned, base = inference.load(dest), inference.load(ctx.assets / "model")
    loss_base, loss_tuned = inference.response_loss(*base, rows), inference.response_loss(*tuned, rows)
    out.say(f"loaded with AutoModelForCausalLM.from_pretrained; loss on the {len(rows)} validation responses: "
            f"base {loss_base:.3f} -> fine-tuned {loss_tuned:.3f}")
    answers = inference.answers(base, tuned, rows)
    right = sum(a.correct for a in answers)
    out.say(f"the fine-tuned model answers {right}/{len(rows)} validation prompts exactly; the first "
            f"{SHOWN_PROMPTS}:")
    for ans in answers[:SHOWN_PROMPTS]:
        out.say(f"prompt:      {ans.prompt}")
        out.say(f"  expected:    {ans.expected}")
        out.say(f"  base model:  {ans.base or '(nothing)'}")
        out.say(f"  fine-tuned:  {ans.fine_tuned or '(nothing)'}   {'PASS' if ans.correct else 'FAIL'}")
    samples = [asdict(a) for a in answers[:SHOWN_PROMPTS]]
    ctx.summary.update(model_loads=True, model_dir=str(dest), generation=samples[0], generations=samples,
                       val_answers={"correct": right, "prompts": len(rows)},
                       val_response_loss={"base": loss_base, "fine_tuned": loss_tuned})
