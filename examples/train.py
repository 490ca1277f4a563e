"""Train a built-in model with autopar on every rank of a torchrun job.

    torchrun --nproc-per-node 4 examples/train.py --model tiny-gpt --steps 5
    autopar plan tiny-gpt --cluster 1x4xcpu -o plan.json
    torchrun --nproc-per-node 4 examples/train.py --plan plan.json

gloo on CPU, NCCL (one GPU per rank) when CUDA is present. Every rank builds the same model from the
same seed and feeds the same global batches; autopar gives each rank its slice.
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
    parser.add_argument("--model", default="tiny-gpt", help="built-in model (tiny-gpt, gpt2, llama3-8b, ...)")
    parser.add_argument("--set", dest="overrides", default=None, help="model dims, e.g. layers=2,hidden=64")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", default=None, help="a plan file from `autopar plan` (default: plan here)")
    parser.add_argument("--losses-out", default=None, help="write the per-step losses here (JSON)")
    args = parser.parse_args()

    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    rank = dist.get_rank()

    bundle = build_model(args.model, overrides=parse_overrides(args.overrides), global_batch=args.global_batch,
                         device=device, seed=args.seed)
    # cluster=None: plan for the world this job runs in (unless --plan gives a saved plan)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, plan=args.plan)
    if rank == 0:
        print(pm.plan.summary(), flush=True)

    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    losses = []
    for step, batch in enumerate(batches(bundle, args.steps, args.seed)):
        batch = [t.to(device) for t in batch]  # the same global batch on every rank
        optimizer.zero_grad()
        loss = pm.step(*batch)  # forward + loss + backward; returns the global mean loss
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}  loss {losses[-1]:.6f}", flush=True)

    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"model": args.model, "world": dist.get_world_size(), "degrees": dict(pm.plan.degrees),
                       "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
