"""Train a built-in model with autopar on every rank of a torchrun job.

    torchrun --nproc-per-node 4 examples/train.py --model tiny-gpt --steps 5
    autopar plan tiny-gpt --cluster 1x4xcpu -o plan.json
    torchrun --nproc-per-node 4 examples/train.py --plan plan.json

    # a model too large for one host: built on the meta device, each rank making only its shards, which
    # start from pretrained weights (a Hugging Face save_pretrained directory, or a torch.save file)
    torchrun --nproc-per-node 4 examples/train.py --model autopar.models.hf:llama --meta --pretrained DIR

    # checkpoint every 10 steps; after a restart on any number of ranks, go on from the last one
    torchrun --nproc-per-node 4 examples/train.py --steps 100 --checkpoint-dir ckpt --save-every 10
    torchrun --nproc-per-node 2 examples/train.py --steps 100 --checkpoint-dir ckpt --resume

gloo on CPU, NCCL (one GPU per rank) when CUDA is present. Every rank builds the same model from the
same seed and feeds the same global batches; autopar gives each rank its slice. A checkpoint
(``autopar.save_checkpoint``) loads under the plan made for whatever world the job restarts in, so an
elastic job (``torchrun --nnodes=MIN:MAX --max-restarts=N ... --resume``) re-plans and continues.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model, parse_overrides
from autopar.testing.parity import batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-gpt", help="built-in model (tiny-gpt, gpt2, llama3-8b, ...) or "
                        "package.module:factory (autopar.models.hf:gpt2, ...)")
    parser.add_argument("--set", dest="overrides", default=None, help="model dims, e.g. layers=2,hidden=64")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-grad-norm", type=float, default=0.0,
                        help="clip the gradients to this total norm over the whole model (0: no clipping)")
    parser.add_argument("--plan", default=None, help="a plan file from `autopar plan` (default: plan here)")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device: each rank makes "
                        "and initializes only its own shards (autoparallelize's deferred initialization)")
    parser.add_argument("--pretrained", default=None, help="start from these weights: a torch.save file, a "
                        ".safetensors file or a Hugging Face save_pretrained directory")
    parser.add_argument("--losses-out", default=None, help="write the per-step losses here (JSON)")
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (one folder per step)")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in --checkpoint-dir, whatever world size wrote it")
    args = parser.parse_args()
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        parser.error("--resume and --save-every need --checkpoint-dir")

    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    rank = dist.get_rank()

    bundle = build_model(args.model, overrides=parse_overrides(args.overrides), global_batch=args.global_batch,
                         device="meta" if args.meta else device, seed=args.seed)
    # cluster=None: plan for the world this job runs in (unless --plan gives a saved plan)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, plan=args.plan)
    if args.pretrained:
        autopar.load_full_state_dict(pm, args.pretrained)  # each rank reads its own shards of the weights
    if rank == 0:
        print(pm.plan.summary(), flush=True)

    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    first = resume(pm, optimizer, args.checkpoint_dir, rank) if args.resume else 0
    losses = []
    for step, batch in enumerate(batches(bundle, args.steps, args.seed)[first:], start=first):
        batch = [t.to(device) for t in batch]  # the same global batch on every rank
        optimizer.zero_grad()
        loss = pm.step(*batch)  # forward + loss + backward; returns the global mean loss
        if args.max_grad_norm:
            pm.clip_grad_norm_(args.max_grad_norm)  # the whole model's norm, all stages and shards
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}  loss {losses[-1]:.6f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:  # collective: every rank writes its shards
            autopar.save_checkpoint(pm, optimizer, autopar.checkpoint_path(args.checkpoint_dir, step + 1), step + 1)

    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"model": args.model, "world": dist.get_world_size(), "degrees": dict(pm.plan.degrees),
                       "first_step": first, "losses": losses}, f)
    dist.destroy_process_group()


def resume(pm: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str, rank: int) -> int:
    """Load the last checkpoint under ``checkpoint_dir`` into this plan (resharded); the step to go on from."""
    path = autopar.latest_checkpoint(checkpoint_dir)
    if path is None:
        if rank == 0:
            print(f"no checkpoint in {checkpoint_dir}: starting at step 0", flush=True)
        return 0
    step = autopar.load_checkpoint(pm, optimizer, path)
    if rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


if __name__ == "__main__":
    main()
