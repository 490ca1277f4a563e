"""The ``autopar`` command line (design.md §3): plan, show, compare, demo.

Exit codes: 0 success; 2 bad input (one line on stderr saying what and where); 3 no plan fits (with the
reason). With ``--json`` the plan JSON is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Sequence

from .errors import AutoparError, BadInputError

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except AutoparError as exc:
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # models' and cost models' input errors are ValueErrors with clear text
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a built-in model (or package.module:factory) for a cluster, offline")
    p.add_argument("model", help="gpt2, gpt3-175b, llama3-8b, llama3-70b, llama3-405b, tiny-gpt, ... or package.module:factory")
    p.add_argument("--cluster", required=True, help="NxGxTYPE, e.g. 16x8xH100 (,ib=400Gbps,nvlink=900GBps) or a JSON file")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--set", dest="overrides", default=None, help="model dims, e.g. layers=2,hidden=64")
    p.add_argument("--fix", default=None, help="pin degrees/options, e.g. dp=8,tp=8,fsdp=0,microbatches=4")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout (and nothing else)")
    p.set_defaults(run=_cmd_plan)

    s = sub.add_parser("show", help="print a plan as a readable table")
    s.add_argument("plan")
    s.set_defaults(run=_cmd_show)

    c = sub.add_parser("compare", help="compare plans side by side")
    c.add_argument("plans", nargs="+")
    c.set_defaults(run=_cmd_compare)

    e = sub.add_parser("explain", help="why an op or parameter got its placement: alternatives and their cost")
    e.add_argument("plan")
    e.add_argument("name", help="a node name (e.g. mm_3) or a parameter (e.g. blocks.0.mlp.fc_in.weight)")
    e.set_defaults(run=_cmd_explain)

    r = sub.add_parser("report", help="one self-contained HTML page of a plan (and a simulated-step trace)")
    r.add_argument("plan")
    r.add_argument("-o", "--output", required=True, help="the HTML file to write")
    r.add_argument("--trace", default=None, help="also write the simulated step as Chrome/Perfetto trace JSON")
    r.set_defaults(run=_cmd_report)

    x = sub.add_parser("export", help="write a Python function that applies the plan with native torch APIs")
    x.add_argument("plan")
    x.add_argument("-o", "--output", required=True, help="the .py file to write")
    x.set_defaults(run=_cmd_export)

    d = sub.add_parser("demo", help="plan a small GPT for this machine and train it on local gloo ranks")
    d.add_argument("--world", type=int, default=4, help="local ranks (default 4)")
    d.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    d.set_defaults(run=_cmd_demo)
    return parser


def parse_pairs(text: str | None, what: str) -> dict[str, Any]:
    """``"dp=2,tp=4,schedule=1F1B"`` -> ``{"dp": 2, "tp": 4, "schedule": "1F1B"}``."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise BadInputError(f"bad {what} item {item!r}: expected key=value")
        value = value.strip()
        out[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from .api import plan, resolve_cluster
    from .models import build_model, parse_overrides

    if args.global_batch < 1:
        raise BadInputError(f"--global-batch must be positive, got {args.global_batch}")
    cluster = resolve_cluster(args.cluster)  # validate before the (slow) capture
    bundle = build_model(args.model, overrides=parse_overrides(args.overrides), global_batch=args.global_batch,
                         seq=args.seq, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("default" if not args.json else "ignore")
        result = plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn,
                      parse_pairs(args.fix, "--fix"), example_targets=bundle.example_targets, name=bundle.name)
    if args.output:
        result.save(args.output)
    print(result.to_json() if args.json else result.summary())
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .plan import Plan

    print(Plan.load(args.plan).summary())
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .api import compare
    from .plan import Plan

    if len(args.plans) < 2:
        raise BadInputError("compare needs at least two plan files")
    print(compare(*(Plan.load(p) for p in args.plans)))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from .plan import Plan

    plan = Plan.load(args.plan)
    try:
        print(plan.explain(args.name))
    except KeyError as exc:
        raise BadInputError(str(exc.args[0])) from None
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .plan import Plan
    from .report_html import render_report
    from .trace import simulated_trace

    plan = Plan.load(args.plan)
    Path(args.output).write_text(render_report(plan))
    if args.trace:
        Path(args.trace).write_text(json.dumps(simulated_trace(plan)))
    print(f"wrote {args.output}" + (f" and {args.trace}" if args.trace else ""))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .export import export_plan
    from .plan import Plan

    source, notes = export_plan(Plan.load(args.plan))
    Path(args.output).write_text(source)
    print(f"wrote {args.output}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    print(run_demo(world=args.world, steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
