"""Stage 2: the tiny model and data, in the cluster's MinIO, and the credentials Secret;
what `make example-assets` does (examples/assets.py), step by step with what it runs."""
from __future__ import annotations

import os

from examples import assets as example

from demo.context import Ctx, shown


def stage_assets(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
    out.stage(2, "Making the tiny model and data, uploading them to MinIO, creating the credentials Secret")
    root = args.workdir / "assets"
    if example.have_local_assets(root):
        out.say(f"tiny model and data already in {root}")
    else:
        out.cmd(f"python -m tools.assets {shown(root)}")
        example.make_local_assets(root)
    ctx.assets = root
    example.upload(root)
    out.say(f"uploaded {root}/model -> s3://{example.BUCKET}/models/tiny, {root}/data -> s3://{example.BUCKET}/data "
            f"(MinIO {ctx.env['AWS_ENDPOINT_URL']})")
    example.apply_secret(args.namespace, {**os.environ, **ctx.env})
    out.say(f"Secret {args.namespace}/{example.SECRET} with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "(values not shown)")
