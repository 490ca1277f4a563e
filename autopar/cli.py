"""The ``autopar`` command line (docs/architecture.md "Command line"): plan, reprice, show, compare, demo.

Exit codes: 0 success; 2 bad input (one line on stderr saying what and where); 3 no plan fits (with the
reason); 141 where stdout's reader has gone (``| head``), quietly. A warning is one line on stderr too.
With ``--json`` the plan JSON is the only thing on stdout. The ``autopar`` command (``console``, also
``python -m autopar``) ends its process once the command has returned, without tearing down what it
loaded (``end_process``). On a terminal, ``plan`` keeps a live progress line on stderr (phase, meshes
solved and pruned, best plan so far and its bound), erased when the plan is printed; it is silent under
``--json`` and when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import select
import shutil
import signal
import sys
import warnings
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence, TextIO

from autopar.core.constraints import KEYS as CONSTRAINT_KEYS, Constraints
from autopar.core.errors import AutoparError, BadInputError

if TYPE_CHECKING:
    from autopar.models import ModelBundle
    from autopar.planning.progress import SearchProgress
    from autopar.ir.problem_file import SavedProblem

DEFAULT_GLOBAL_BATCH = 8


UNCOLLECTED = ("plan", "reprice", "show", "compare", "explain", "report", "export")
"""The commands that load a model or plans, work on them and end: in the process ``console`` ends they run
with Python's cyclic garbage collector off. What they make (the captured graph, the search's records, the
plan) lives until the process ends anyway, and each collection rescanned it for nothing: with the pauses of
the import and of the search (``core/collector``) too, a pinned Llama 3 70B pipeline's plan took 4.3 s
against 4.9 s with only the search's on the 2-core development machine, for about 10 MB more at the peak.
``demo`` (training on local ranks) and ``calibrate`` keep it."""


def main(argv: Sequence[str] | None = None, *, ends_process: bool = False) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``) and return its exit code. ``ends_process``: the
    caller ends the process right after (``console``), so the commands of ``UNCOLLECTED`` run uncollected."""
    parser = _parser()
    args = parser.parse_args(argv)
    if ends_process and args.command in UNCOLLECTED:
        gc.disable()
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line(args.command)
        try:
            return args.run(args)
        except AutoparError as exc:  # anything else is a bug in autopar: its traceback is kept (exit 1)
            print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
            return exc.exit_code


def _warning_line(command: str) -> Callable[..., None]:
    """How ``command`` shows a warning: one line on stderr in the form of its errors (``autopar plan:
    warning: no DTensor sharding strategy for ...``), the category named unless a plain ``UserWarning``,
    instead of Python's file, line number and line of source (autopar's warnings say what they concern)."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        kind = "" if category is UserWarning else f"{category.__name__}: "
        text = str(message).removeprefix("autopar: ")
        (file or sys.stderr).write(f"autopar {command}: warning: {kind}{text}\n")
    return show


def console() -> NoReturn:
    """The ``autopar`` command (setup.cfg's console script, and ``python -m autopar``): ``main`` on
    ``sys.argv``, then ``end_process`` with its exit code. Where stdout's reader has gone (``autopar plan
    ... --json | head``) the command ends quietly (``_reader_gone``); any other exception (argparse's
    ``SystemExit``, a bug's traceback) leaves the ordinary way."""
    try:
        code = main(ends_process=True)
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe broke (a planning worker's): a bug's traceback
        code = _reader_gone()
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End this process with ``code`` once its exit handlers (``atexit``: logging's, ``weakref.finalize``'s
    temporary folders, multiprocessing's) have run and its output is flushed, but without Python's
    teardown of every module and object the command loaded: torch, its distributed packages, and after
    a plan the captured graph and the search's records. That teardown does nothing the command needs
    (each file autopar writes is closed as it is written, ``core/files.write_atomically``) and took 0.45 s
    after ``import autopar.cli`` alone and 0.8 s after pinning Llama 3 8B's degrees on the 2-core
    development machine: a sixth of that command's wall time."""
    atexit._run_exitfuncs()  # what Python's exit runs first (and forgets them); ``os._exit`` runs none
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _reader_gone()
    except ValueError:  # stdout closed: nothing left to write
        pass
    try:
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass
    os._exit(code)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone: polled, it reports an error or a hang-up
    (False where the platform cannot poll it)."""
    if not hasattr(select, "poll"):
        return False
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _reader_gone() -> int:
    """What is left for stdout, whose reader has gone, is sent nowhere, and the exit code is the one a
    process SIGPIPE ended reports (128 + SIGPIPE; 1 where the platform has no SIGPIPE), as ``head`` ends a
    pipeline, instead of Python's traceback of a ``BrokenPipeError``."""
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, sys.stdout.fileno())
    os.close(nowhere)
    sigpipe = getattr(signal, "SIGPIPE", None)
    return 128 + int(sigpipe) if sigpipe is not None else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a built-in model (or package.module:factory) for a cluster, offline")
    p.add_argument("model", nargs="?", default=None,
                   help="gpt2, gpt3-175b, llama3-8b, llama3-70b, llama3-405b, tiny-gpt, ... or package.module:factory "
                        "(omit with --problem)")
    p.add_argument("--cluster", required=True, help="NxGxTYPE, e.g. 16x8xH100 (,ib=400Gbps,nvlink=900GBps) or a JSON file")
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--set", dest="overrides", default=None, help="model dims, e.g. layers=2,hidden=64")
    p.add_argument("--fix", default=None, help="pin degrees/options, e.g. dp=8,tp=8,fsdp=0,microbatches=4 "
                   f"(keys: {', '.join(CONSTRAINT_KEYS)}; meanings: autopar.core.constraints.Constraints)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout (and nothing else)")
    p.add_argument("--save-problem", default=None, help="also write the captured planning problem here (for "
                   "`plan --problem` and `reprice`, which skip the capture)")
    p.add_argument("--problem", default=None, help="plan a problem saved with --save-problem instead of MODEL")
    p.set_defaults(run=_cmd_plan)

    w = sub.add_parser("reprice", help="price a plan's exact placements on another cluster of the same size, "
                                        "from its saved problem (what-if, no capture)")
    w.add_argument("plan")
    w.add_argument("--problem", required=True, help="the problem file saved with `autopar plan ... --save-problem`")
    w.add_argument("--cluster", required=True, help="NxGxTYPE with overrides, e.g. 2x8xH100,ib=200Gbps")
    w.add_argument("-o", "--output", default=None, help="write the re-priced plan JSON here")
    w.add_argument("--json", action="store_true", help="print the re-priced plan JSON on stdout (and nothing else)")
    w.set_defaults(run=_cmd_reprice)

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

    k = sub.add_parser("calibrate", help="measure this machine (matmuls, memory, collectives) and write a cluster "
                                          "profile for --cluster")
    k.add_argument("-o", "--output", default="calibrated-cluster.json", help="the profile JSON to write "
                   "(default calibrated-cluster.json)")
    k.add_argument("--ranks", type=int, default=None, help="spawn N local gloo ranks (default: the ranks of the "
                   "torchrun job this runs in, else 1)")
    k.add_argument("--quick", action="store_true", help="fewer and smaller sizes: seconds instead of a minute")
    k.set_defaults(run=_cmd_calibrate)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    from autopar.api import plan, resolve_cluster

    constraints = Constraints.parse(args.fix)  # checked, like the cluster, before the model is built and captured
    cluster = resolve_cluster(args.cluster)
    _check_outputs(args, "output", "save_problem")
    line = ProgressLine(sys.stderr) if sys.stderr.isatty() and not args.json else None
    with warnings.catch_warnings():
        warnings.simplefilter("default" if not args.json else "ignore")
        try:
            if args.problem:
                result = plan(_saved_problem(args), cluster=cluster, constraints=constraints,
                              save_problem=args.save_problem, progress=line)
            else:
                bundle = _model_bundle(args)
                result = plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                              example_targets=bundle.example_targets, name=bundle.name,
                              save_problem=args.save_problem, progress=line)
        finally:
            if line is not None:
                line.clear()
    if args.output:
        result.save(args.output)
    print(result.to_json() if args.json else result.summary())
    return 0


def _check_outputs(args: argparse.Namespace, *names: str) -> None:
    """Refuse unusable output paths of the options ``names`` before any work (``core/files.py``)."""
    from autopar.core.files import check_writable

    for name in names:
        if getattr(args, name) is not None:
            check_writable(getattr(args, name), "--" + name.replace("_", "-"))


class ProgressLine:
    """The search's progress on one line of a terminal, rewritten in place (``SearchProgress.line``)."""

    def __init__(self, stream: TextIO):
        self.stream, self.width = stream, 0

    def __call__(self, progress: SearchProgress) -> None:
        text = progress.line()[:shutil.get_terminal_size().columns - 1]
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _model_bundle(args: argparse.Namespace) -> ModelBundle:
    from autopar.models import build_model, parse_overrides

    if args.model is None:
        raise BadInputError("give a MODEL to plan (or --problem FILE saved with --save-problem)")
    batch = DEFAULT_GLOBAL_BATCH if args.global_batch is None else args.global_batch
    if batch < 1:
        raise BadInputError(f"--global-batch must be positive, got {batch}")
    return build_model(args.model, overrides=parse_overrides(args.overrides), global_batch=batch,
                       seq=args.seq, device="meta")


def _saved_problem(args: argparse.Namespace) -> SavedProblem:
    """The problem of ``--problem``, refusing what would change its graph (that needs a new capture)."""
    from autopar.ir.problem_file import load_problem

    if args.model is not None:
        raise BadInputError(f"give MODEL or --problem, not both: {args.problem} already holds a captured model")
    changes = [flag for flag, value in (("--global-batch", args.global_batch), ("--seq", args.seq),
                                        ("--set", args.overrides)) if value is not None]
    if changes:
        raise BadInputError(f"{', '.join(changes)} would change the captured graph that --problem fixes: "
                            f"capture again with `autopar plan MODEL {changes[0]} ... --save-problem FILE`")
    return load_problem(args.problem)


def _cmd_reprice(args: argparse.Namespace) -> int:
    from autopar.api import compare, resolve_cluster
    from autopar.core.plan import Plan
    from autopar.ir.problem_file import load_problem
    from autopar.core.units import fmt_bytes
    from autopar.api import reprice

    old = Plan.load(args.plan)
    cluster = resolve_cluster(args.cluster)
    _check_outputs(args, "output")
    with warnings.catch_warnings():
        warnings.simplefilter("default" if not args.json else "ignore")
        new = reprice(old, load_problem(args.problem), cluster)
    if args.output:
        new.save(args.output)
    if args.json:
        print(new.to_json())
        return 0
    print(compare(old, new))
    peak, capacity = new.predicted["peak_memory_bytes"], new.predicted["memory_capacity_bytes"]
    if peak > capacity:
        print(f"note: the re-priced plan needs {fmt_bytes(peak)} per device, more than the "
              f"{fmt_bytes(capacity)} of {cluster.spec}: re-solve with `autopar plan --problem ...`")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from autopar.core.plan import Plan

    print(Plan.load(args.plan).summary())
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from autopar.api import compare
    from autopar.core.plan import Plan

    if len(args.plans) < 2:
        raise BadInputError("compare needs at least two plan files")
    print(compare(*(Plan.load(p) for p in args.plans)))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from autopar.core.plan import Plan

    plan = Plan.load(args.plan)
    print(plan.explain(args.name))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from autopar.core.files import write_atomically
    from autopar.core.plan import Plan
    from autopar.inspect.report_html import render_report
    from autopar.inspect.trace import simulated_trace

    _check_outputs(args, "output", "trace")
    plan = Plan.load(args.plan)
    write_atomically(args.output, render_report(plan))
    if args.trace:
        write_atomically(args.trace, json.dumps(simulated_trace(plan)))
    print(f"wrote {args.output}" + (f" and {args.trace}" if args.trace else ""))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from autopar.core.files import write_atomically
    from autopar.inspect.export import export_plan
    from autopar.core.plan import Plan

    _check_outputs(args, "output")
    source, notes = export_plan(Plan.load(args.plan))
    write_atomically(args.output, source)
    print(f"wrote {args.output}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from autopar.demo import run_demo

    if args.world < 1 or args.steps < 1:
        raise BadInputError(f"--world and --steps must be positive, got --world {args.world} --steps {args.steps}")
    print(run_demo(world=args.world, steps=args.steps))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import os

    from autopar.cost_models.calibrate import (build_profile, measure_in_job, measure_spawned_rank, profile_source,
                                        profile_summary, profile_text)
    from autopar.core.files import write_atomically
    from autopar.testing.launch import run_on_ranks

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.ranks is not None and (args.ranks < 1 or under_torchrun):
        raise BadInputError(f"--ranks must be a positive number of local ranks to spawn, and is not used under "
                            f"torchrun (which gives the ranks); got {args.ranks}")
    _check_outputs(args, "output")
    if under_torchrun:
        measured = measure_in_job(args.quick)
    else:
        measured = run_on_ranks(measure_spawned_rank, args.ranks or 1, args.quick)[0]
    if measured is None:  # ranks other than 0 of a torchrun job
        return 0
    profile = build_profile(measured, profile_source())
    write_atomically(args.output, profile_text(profile))
    print(profile_summary(profile))
    print(f"wrote {args.output} (plan with --cluster {args.output})")
    return 0


if __name__ == "__main__":
    console()
