"""The OpInfo sweep: every sample of PyTorch's ``op_db`` under the engine, against eager.

    python -m tests.fidelity.opinfo --full          # everything; writes tests/fidelity/RESULTS.md
    python -m tests.fidelity.opinfo --ops add,mm --devices cpu --backends exact

Per device x backend x dtype it counts samples run, identical, fallbacks by reason, and
failures per op (mismatches, crashes, silent fallbacks); on ``neuron`` a separate column
counts samples where plain eager on the device differs from cpu (a device bug, not the
engine's). Each finished op is appended to a JSON-lines log (``--log``) as it completes, so
an interrupted sweep resumes where it stopped (``--resume``) and a hard crash of the process
is recorded against the op that was running. ``harness.py`` says how each sample runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

# Measurements of the engine turn off the decisions taken from wall-clock timings: a sample
# must never pass because the engine stepped aside.
os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
os.environ["NEURON_ADAPTIVE_EAGER_RETIRE_RATIO"] = "0"

import torch  # noqa: E402

from . import harness, summary  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("forward", "grad", "autocast", "error")

# Autocast: ops in the families autocast changes (matmul, conv, linear, softmax, layer_norm,
# losses) and elementwise ops beside them.
AUTOCAST_OPS = (
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "nn.functional.conv1d",
    "nn.functional.conv2d", "softmax", "log_softmax", "nn.functional.layer_norm",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.nll_loss",
    "nn.functional.binary_cross_entropy_with_logits", "add", "mul", "exp", "sigmoid",
    "nn.functional.gelu", "sum",
)


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def op_id(op) -> str:
    """The OpInfo's name, with its variant (``norm.nuc``): several OpInfos share a name."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def cpu_dtypes(op) -> set:
    return set(op.supported_dtypes("cpu"))


def samples(op, device, dtype, grad: bool, limit: int | None):
    """The OpInfo's samples for ``device`` (generated there, seeded alike on every device,
    so the emulated device's samples hold the CPU's values)."""
    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs(device, dtype, requires_grad=grad):
        out.append(s)
        if limit is not None and len(out) >= limit:
            break
    return out


def error_inputs(op, device, limit):
    if op.error_inputs_func is None:
        return []
    torch.manual_seed(0)
    out = []
    for e in op.error_inputs(device):
        out.append(e)
        if limit is not None and len(out) >= limit:
            break
    return out


# ---------------------------------------------------------------------------- the sweep


def _record(log, **fields):
    log.write(json.dumps(fields) + "\n")
    log.flush()


# Samples run together in one step (one graph with inductor). An op's samples are split into
# steps of at most this many: max_pool1d's 864 samples in one step made a graph Inductor took
# 5-20 minutes and gigabytes to compile.
CASE_SAMPLES = 64


def run_op(op, device, backend, dtype_name, kind, limit, log, skip=0) -> list[dict]:
    """Run one op for one combination; append its records to ``log`` and return them.
    ``skip``: the samples an earlier, stopped run of it logged (Note [Resuming an op])."""
    dtype = DTYPES.get(dtype_name)
    base = dict(op=op_id(op), device=device, backend=backend, dtype=dtype_name, kind=kind)
    records = []

    def emit(i, outcome, device_diff=None):
        rec = dict(base, sample=i, status=outcome.status, reasons=list(outcome.reasons),
                   detail=outcome.detail[:400], device_diff=device_diff)
        records.append(rec)
        _record(log, **rec)

    if kind == "error":
        for i, e in enumerate(error_inputs(op, device, limit)):
            if i >= skip:
                emit(i, harness.run_error_input(op, device, e, backend))
        return records
    grad = kind == "grad"
    try:
        ss = samples(op, device, dtype if kind != "autocast" else torch.float32, grad, limit)
    except Exception as e:  # noqa: BLE001 -- a sample generator the device cannot run
        emit(0, harness.Outcome("skipped", detail=f"samples on {device}: {e!r}"[:300]))
        return records
    if not ss:
        return records
    cpu = (samples(op, "cpu", dtype, grad, limit)
           if device != "cpu" and kind in ("forward", "grad") else None)
    # each step's samples are logged as it ends, so that a stopped run resumes at the step
    # it was in (Note [Resuming an op])
    for at in range(skip - skip % CASE_SAMPLES, len(ss), CASE_SAMPLES):
        part = slice(at, at + CASE_SAMPLES)
        case = harness.Case(op, dtype if kind != "autocast" else torch.float32, device,
                            ss[part], grad=grad, autocast=dtype if kind == "autocast" else None,
                            cpu_samples=None if cpu is None else cpu[part])
        try:
            outcomes = harness.run_case(case, backend)
        except Exception as e:  # noqa: BLE001 -- the harness itself failed: a failure to look at
            crash = harness.Outcome("crash", detail=f"harness: {e!r}"[:400])
            outcomes = [crash] * len(case.samples)
        for i, outcome in enumerate(outcomes, at):
            diff = None
            if cpu is not None:
                # the device column: every forward sample in the exact half (plain eager on
                # the device does not depend on the engine's backend); elsewhere where the
                # engine failed (run_case checks those first)
                if outcome.device_diff:
                    diff = outcome.device_diff
                elif (kind == "forward" and backend == "exact") or outcome.failed:
                    diff = harness.device_differs(
                        harness.Case(op, dtype, device, [ss[i]], grad=grad), [cpu[i]])
            if outcome.failed and diff:
                # plain eager on the device is already wrong on this sample (it differs from
                # cpu, or raises where cpu runs): the engine cannot be judged against it
                # until the device is fixed
                outcome = harness.Outcome("device-bug", detail=f"plain eager on {device} "
                                          f"differs from cpu ({diff}); {outcome.detail}")
            if i >= skip:
                emit(i, outcome, diff)
    return records


def _device_check(rec) -> str | None:
    """For an op that took the sweep's process down: does plain eager on its device differ
    from cpu on any of its samples (then the device is at fault, and the engine cannot be
    judged on the op)? Checked in a process of its own, which the device may take down too."""
    if rec["device"] == "cpu" or rec["kind"] not in ("forward", "grad"):
        return None
    cmd = [sys.executable, "-m", "tests.fidelity.opinfo", "--device-check", "--ops", rec["op"],
           "--devices", rec["device"], "--dtypes", rec["dtype"], "--kinds", rec["kind"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return f"plain eager on {rec['device']} takes the process down too (exit {r.returncode})"
    diffs = [d for d in json.loads(r.stdout.strip().splitlines()[-1]) if d]
    return diffs[0] if diffs else None


def device_check(op, device, dtype_name, kind, limit) -> list:
    """Per sample: what plain eager on ``device`` does otherwise than on cpu (None: same)."""
    dtype, grad = DTYPES[dtype_name], kind == "grad"
    if device == "neuron":
        import adaptive_eager.neuron  # noqa: F401 -- registers the device
    pairs = zip(samples(op, device, dtype, grad, limit), samples(op, "cpu", dtype, grad, limit))
    return [harness.device_differs(harness.Case(op, dtype, device, [s], grad=grad), [c])
            for s, c in pairs]


def plan(ops, devices, backends, dtypes, kinds):
    """(op, device, backend, dtype, kind) in the order the sweep runs them."""
    for backend in backends:  # exact everywhere first: it is the fast, bitwise half
        for device in devices:
            for kind in kinds:
                for op in ops:
                    supported = cpu_dtypes(op)
                    if kind == "error":
                        yield op, device, backend, "-", kind
                        continue
                    if kind == "autocast":
                        if op.name not in AUTOCAST_OPS or torch.float32 not in supported:
                            continue
                        for name in dtypes:
                            if name != "float32":
                                yield op, device, backend, name, kind
                        continue
                    if kind == "grad":
                        if not op.supports_autograd:
                            continue
                        supported = set(op.supported_backward_dtypes("cpu"))
                    for name in dtypes:
                        if DTYPES[name] in supported:
                            yield op, device, backend, name, kind


_key = summary.key


def sweep(ops, devices, backends, dtypes, kinds, limit, log_path, resume, progress=True,
          summary_path=summary.SUMMARY, died=False):
    """``died``: this sweep's previous child died; the op it began last is a crash. Any other op
    begun and never finished (a sweep killed from outside, say at a session's end) runs again."""
    done, started, last = set(), {}, None
    have = {}  # an unfinished run's key -> the samples it logged (Note [Resuming an op])
    if resume and summary_path:
        done |= set(summary.read(summary_path))
    if resume and summary_path:
        # Note [Runs under way]
        _start_from_partial(log_path, devices, partial_for(summary_path))
    if resume and os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                rec = json.loads(line)
                k = _key(rec["op"], rec["device"], rec["backend"], rec["dtype"], rec["kind"])
                if rec.get("begin"):
                    started[k], last = rec, k
                    done.discard(k)
                    have[k] = rec.get("resumed_from", 0)
                elif rec.get("end") or rec.get("begin") is False:
                    done.add(k)
                    have.pop(k, None)
                elif "status" in rec and k in have and rec.get("sample") == have[k]:
                    have[k] += 1
    items = list(plan(ops, devices, backends, dtypes, kinds))
    if "neuron" in devices:
        import adaptive_eager.neuron  # noqa: F401 -- registers the device
    t0 = time.time()
    with open(log_path, "a" if resume else "w") as log:
        # an op that the previous child began last and never finished took the child down
        for k, rec in started.items():
            if died and k == last and k not in done:
                diff = _device_check(rec)
                status, detail = (("device-bug", "the sweep process died while running this "
                                   f"op; plain eager on {rec['device']} differs from cpu "
                                   f"({diff})") if diff else
                                  ("crash", "the sweep process died while running this op"))
                _record(log, **{**rec, "begin": False}, sample=0, status=status, reasons=[],
                        detail=detail[:400], device_diff=diff)
                done.add(k)
        for n, (op, device, backend, dtype, kind) in enumerate(items):
            k = _key(op_id(op), device, backend, dtype, kind)
            if k in done:
                continue
            skip = have.get(k, 0) if k not in done else 0
            _record(log, begin=True, op=op_id(op), device=device, backend=backend, dtype=dtype,
                    kind=kind, **({"resumed_from": skip} if skip else {}))
            start = time.time()
            try:
                recs = run_op(op, device, backend, dtype, kind, limit, log, skip)
            except _Stop:
                _record(log, stopped=True, op=op_id(op), device=device, backend=backend,
                        dtype=dtype, kind=kind)
                raise
            # an op with no sample writes nothing else: without this it would look unfinished
            _record(log, end=True, op=op_id(op), device=device, backend=backend, dtype=dtype,
                    kind=kind)
            if progress:
                bad = [r for r in recs if r["status"] in ("mismatch", "crash", "silent")]
                print(f"[{n + 1}/{len(items)} {time.time() - t0:7.0f}s] {k}: {len(recs)} "
                      f"samples {time.time() - start:.1f}s"
                      + (f"  FAILED {len(bad)}: {bad[0]['status']} {bad[0]['detail'][:160]}"
                         if bad else ""), flush=True)


# ---------------------------------------------------------------------------- results


def _scan(log_paths: str) -> tuple[dict, dict, dict]:
    """What the logs (a comma list: sweeps run side by side, one device each) hold, by op key:
    the sample records of each op's last finished run; the samples of the runs under way; and
    the begin record of each run under way. A run is finished by its end record, or by the
    crash record a sweep writes for an op that took its child down; a run begun and never
    finished (a sweep killed from outside) or stopped is under way."""
    runs, open_runs, begins = {}, {}, {}
    for path in log_paths.split(","):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                k = _key(rec["op"], rec["device"], rec["backend"], rec["dtype"], rec["kind"])
                if rec.get("begin"):
                    # a resumed run goes on from the samples its stopped run logged
                    open_runs[k] = open_runs.get(k, [])[:rec.get("resumed_from", 0)]
                    begins[k] = rec
                elif rec.get("stopped"):
                    pass  # unfinished: not a run, but a resumed one keeps its samples
                elif rec.get("end"):
                    runs[k] = open_runs.pop(k, [])
                    begins.pop(k, None)
                elif rec.get("begin") is False:  # a crash record
                    runs[k] = open_runs.pop(k, []) + [rec]
                    begins.pop(k, None)
                elif "status" in rec:
                    open_runs.setdefault(k, []).append(rec)
    return runs, open_runs, begins


def _runs(log_paths: str) -> dict:
    """op key -> the sample records of its last finished run in the logs (``_scan``)."""
    return _scan(log_paths)[0]


def load(log_paths: str) -> list[dict]:
    """The sample records of the logs' finished op runs (the last run of each op)."""
    return [rec for recs in _runs(log_paths).values() for rec in recs]


# Note [Runs under way]: the logs are not kept with the repository (they are large), so a
# run stopped midway (Note [Resuming an op]) would lose its samples with the machine: --compact
# also writes the samples of the runs under way beside the summary (``sweep_partial.jsonl``
# beside ``sweep_summary.jsonl``), which is kept, and a resumed sweep whose log does not exist
# yet starts its log from it (the runs of its own devices).
def partial_for(summary_path: str) -> str:
    """Where the samples of runs under way are kept: beside the summary."""
    return os.path.join(os.path.dirname(os.path.abspath(summary_path)), "sweep_partial.jsonl")


def _under_way(log_paths: str) -> list[dict]:
    """The records of the logs' runs begun and not finished: each one's begin record (as a
    resumed run's, from the samples logged in a row) and those samples."""
    _, open_runs, out = _scan(log_paths)
    lines = []
    for k, begin in out.items():
        samples = open_runs.get(k, [])
        n = 0
        while n < len(samples) and samples[n]["sample"] == n:
            n += 1
        if n:
            lines.append({key: v for key, v in begin.items() if key != "resumed_from"})
            lines += samples[:n]
    return lines


def write_partial(log_paths: str | None, path: str) -> int:
    """Write the samples of the logs' runs under way to ``path``; returns how many."""
    lines = _under_way(log_paths) if log_paths else []
    with open(path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    return sum("status" in x for x in lines)


def _start_from_partial(log_path: str, devices, partial: str) -> None:
    """A new log starts with the runs under way that ``partial`` holds for ``devices``."""
    if os.path.exists(log_path) or not os.path.exists(partial):
        return
    with open(partial) as f:
        lines = [x for x in f if json.loads(x)["device"] in devices]
    if lines:
        with open(log_path, "w") as f:
            f.writelines(lines)


def finished(log_paths: str) -> set:
    """Keys of the ops the logs hold a finished run of."""
    return set(_runs(log_paths))


def logged(log_paths: str | None, summary_path: str | None) -> list[dict]:
    """The summary lines of the op runs that the summary file and the logs hold (a log's run
    over the summary's: Note [Sweep summary])."""
    lines = summary.read(summary_path) if summary_path else {}
    if not log_paths:
        return list(lines.values())
    records = load(log_paths)
    empty = finished(log_paths) - {_key(r["op"], r["device"], r["backend"], r["dtype"],
                                        r["kind"]) for r in records}
    return list(summary.merged(lines, empty, records).values())


def write_results(lines, command: str, path=RESULTS, elapsed: float | None = None,
                  partial: int = 0):
    """RESULTS.md from summary lines (summary.py)."""
    table = summary.table(lines)
    what = "Written from the sweep's logs by" if "--report" in command else "Command"
    lines = [
        "# OpInfo under the engine",
        "",
        f"Date: {datetime.date.today().isoformat()}. torch {torch.__version__}. {what}:",
        "",
        f"    {command}",
        "",
    ]
    if elapsed is not None:
        lines += [f"Wall time of the sweep: {elapsed / 60:.0f} min.", ""]
    if partial:
        lines += [f"**Partial**: {partial} of the planned op runs (op x device x backend x "
                  "dtype x kind) had not run when this was written; the rows are what the "
                  "logs held (the sweep resumes with `--resume`).", ""]
    lines += [
        "Each sample runs inside a recurring step driven hot (tests/fidelity/harness.py): "
        "inputs produced by a deferred op, the result consumed by one, the step ending at a "
        "host read. An op's samples run together in one step (with inductor, one graph), "
        "each judged from the engine's counters around its ops, and alone where those cannot "
        "tell or where it differs from eager. *identical*: every run equals eager (exact: "
        "bitwise; inductor: the "
        "OpInfo's tolerances) and the last run was deferred and replayed with no fallback. "
        "*fallback*: equal to eager, but the engine took a counted fallback or boundary "
        "(reasons below). *host*: 0-dim cpu tensors, run on the host by design. *no op*: the "
        "sample issues no op on the device (shape functions). *dispatch mode*: differs from "
        "plain eager exactly as eager under a pass-through dispatch mode does (Note [Any "
        "dispatch mode] in harness.py), a property of intercepting through a mode. *eager "
        "nondet.*: eager differs from itself; compared within tolerance. "
        "*eager error*: eager raises on the sample; the engine raised the same type. "
        "*failed*: a mismatch, a crash, or a silent fallback. *device differs*: plain eager "
        "on neuron differs from plain eager on cpu (the device's bug, not the engine's). "
        "Where plain eager on neuron is not even reproducible (it differs from itself), the "
        "engine cannot be judged on the sample: it counts as device differs only. "
        "*equal %*: samples whose every run equals eager (identical, fallback, host) among "
        "those judged (all but no op, eager error, eager nondet., skipped and the "
        "unreproducible device samples); *deferred %*: "
        "identical ones, the engine deferring and replaying the sample.",
        "",
        "| device | backend | dtype | kind | samples | identical | fallback | host | no op | "
        "dispatch mode | eager error | eager nondet. | skipped | failed | equal % | "
        "deferred % | device differs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(table):
        row = table[key]
        judged = (row["run"] - row["eager_error"] - row["skipped"] - row["no_op"]
                  - row["eager_nondeterministic"] - row["device_bug"])
        equal = row["identical"] + row["fallback"] + row["host"]
        pct = lambda n: f"{100.0 * n / judged:.2f}" if judged else "-"  # noqa: E731
        lines.append("| " + " | ".join(key) + " | " + " | ".join(str(row[c]) for c in (
            "run", "identical", "fallback", "host", "no_op", "dispatch_mode", "eager_error",
            "eager_nondeterministic", "skipped", "failed")) + f" | {pct(equal)} | "
            f"{pct(row['identical'])} | {row['device_diff']} |")
    lines += ["", "## Fallbacks by reason", ""]
    for key in sorted(table):
        if table[key]["reasons"]:
            lines.append(f"- {' / '.join(key)}: " + "; ".join(
                f"{reason} ({n})" for reason, n in table[key]["reasons"].most_common()))
    for status, title in (("dispatch-mode", "Ops that differ under any dispatch mode"),
                          ("eager-nondeterministic", "Ops whose eager result varies run to run")):
        lines += ["", f"## {title}", ""]
        noted = [(key, table[key]["noted"][status]) for key in sorted(table)
                 if table[key]["noted"][status]]
        lines += [f"- {' / '.join(key)}: " + ", ".join(f"`{op}` ({n})" for op, n in
                                                     sorted(ops.items())) for key, ops in noted]
        if not noted:
            lines.append("None.")
    lines += ["", "## Failures per op", ""]
    any_failure = False
    for key in sorted(table):
        for op, fails in sorted(table[key]["failures"].items()):
            any_failure = True
            lines.append(f"- {' / '.join(key)} `{op}` ({len(fails)}): {fails[0][:300]}")
    if not any_failure:
        lines.append("None.")
    lines += ["", "## Plain eager on neuron differs from cpu (device bugs)", ""]
    any_device = False
    for key in sorted(table):
        if table[key]["device_ops"]:
            any_device = True
            lines.append(f"- {' / '.join(key)}: " + ", ".join(
                f"`{op}` ({n})" for op, n in sorted(table[key]["device_ops"].items())))
    if not any_device:
        lines.append("None.")
    kept = ""  # what follows KEPT in the file (the programs' figures) is not the sweep's
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if KEPT in old:
            kept = "\n" + old[old.index(KEPT):]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + kept)


KEPT = "<!-- kept by --report: the figures below are not the sweep's -->"


# Note [Stopping a sweep]: a sweep stopped on purpose (SIGTERM, say from ``timeout``, or
# Ctrl-C) marks the op it was running as stopped, not crashed, so that --resume runs it again;
# the parent passes the signal on to its child.
#
# Note [Resuming an op]: an op's samples are logged one step (CASE_SAMPLES) at a time, and a
# run stopped or killed midway resumes at the step it was in: its begin record says
# ``resumed_from`` (the samples logged in a row from the first), the samples are generated
# alike (seeded), and the run's records are those logged before it plus the new ones. Before,
# a run restarted from its first sample: max_pool2d_with_indices_backward's gradients (1,440
# samples, 76 minutes on cpu) never finished within a session that also had other work.
_STOPPED = 3


class _Stop(BaseException):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signum)


def _call_child(cmd) -> int:
    child = subprocess.Popen(cmd)

    def forward(signum, frame):
        child.send_signal(signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # the child got it too (same process group)
                continue
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tests.fidelity.opinfo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help="every op, dtype, device, backend and kind; writes RESULTS.md")
    p.add_argument("--ops", help="comma list of OpInfo names (default: all)")
    p.add_argument("--devices", default="cpu,neuron")
    p.add_argument("--backends", default="exact,inductor")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--samples", type=int, default=None, help="samples per op (default: all)")
    p.add_argument("--log", default=None,
                   help="the JSON-lines log (default tests/fidelity/sweep.jsonl); with --report "
                        "and --compact, a comma list of logs (default: none)")
    p.add_argument("--summary", default=summary.SUMMARY,
                   help="the sweep's durable record, one line per op run (summary.py)")
    p.add_argument("--resume", action="store_true",
                   help="skip what --log and --summary already hold")
    p.add_argument("--report", action="store_true",
                   help="run nothing: write RESULTS.md from what --summary and --log hold")
    p.add_argument("--compact", action="store_true",
                   help="run nothing: fold the op runs of --log into --summary")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--died", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device-check", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", default=None,
                   help="write the summary here (default with --full: RESULTS.md)")
    a = p.parse_args(argv)
    db = op_db()
    if a.ops:
        names = a.ops.split(",")
        ops = [op for op in db if op.name in names or op_id(op) in names]
        unknown = [n for n in names if not any(n in (op.name, op_id(op)) for op in ops)]
        if unknown:
            p.error(f"--ops: unknown OpInfo names {unknown}; see "
                    f"torch.testing._internal.common_methods_invocations.op_db")
    else:
        ops = db
    choices = dict(devices=("cpu", "neuron"), backends=("exact", "inductor"),
                   dtypes=tuple(DTYPES), kinds=KINDS)
    lists = {}
    for name, accepted in choices.items():
        lists[name] = getattr(a, name).split(",")
        bad = [v for v in lists[name] if v not in accepted]
        if bad:
            p.error(f"--{name}: {bad} not accepted; accepted: {', '.join(accepted)}")
    if a.log is None and not (a.report or a.compact):
        a.log = os.path.join(HERE, "sweep.jsonl")
    start = time.time()
    if a.device_check:  # one op, device, dtype and kind (_device_check)
        op = next(op for op in ops if op_id(op) == a.ops)
        print(json.dumps(device_check(op, lists["devices"][0], lists["dtypes"][0],
                                      lists["kinds"][0], a.samples)))
        return 0
    if a.report or a.compact:
        for path in (a.log or "").split(","):
            if path and not os.path.exists(path):
                p.error(f"--log: {path} does not exist")
        lines = logged(a.log, a.summary)
        if a.compact:
            summary.write({_key(x["op"], x["device"], x["backend"], x["dtype"], x["kind"]): x
                           for x in lines}, a.summary)
            partial = partial_for(a.summary)
            kept = write_partial(a.log, partial)
            print(f"wrote {a.summary}: {len(lines)} op runs; {partial}: {kept} samples of "
                  "op runs under way")
            return 0
        done = {_key(x["op"], x["device"], x["backend"], x["dtype"], x["kind"]) for x in lines}
        missing = sum(_key(op_id(op), *rest) not in done for op, *rest in plan(
            ops, lists["devices"], lists["backends"], lists["dtypes"], lists["kinds"]))
        write_results(lines, "python -m tests.fidelity.opinfo " + " ".join(
            argv if argv is not None else sys.argv[1:]), a.results or RESULTS, partial=missing)
        print(f"wrote {a.results or RESULTS}" + (f" ({missing} op runs missing)" if missing
                                                 else ""))
        return 0
    if a.child:
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGINT, _raise_stop)
        try:
            sweep(ops, lists["devices"], lists["backends"], lists["dtypes"], lists["kinds"],
                  a.samples, a.log, a.resume, summary_path=a.summary, died=a.died)
        except _Stop:
            return _STOPPED
        return 0
    # Note [Sweep in a child]: a few device bugs abort the process (tests/fidelity/
    # RESULTS.md). The sweep runs in a child process; when one dies, the next resumes after
    # the op it died on, which is recorded as a crash.
    argv_child = [x for x in (argv if argv is not None else sys.argv[1:])
                  if x not in ("--full", "--resume")]
    resume, died = a.resume, False
    for attempt in range(200):
        cmd = [sys.executable, "-m", "tests.fidelity.opinfo", *argv_child, "--child"]
        # a sweep that was not resumed runs what the summary holds again; a child resuming
        # after its predecessor died skips only what this sweep's log holds
        rc = _call_child(cmd + (["--resume"] if resume else [])
                         + ([] if a.resume else ["--summary", ""]) + (["--died"] if died else []))
        if rc == 0:
            break
        if rc == _STOPPED:
            print("sweep stopped: --resume goes on from the op it was running", flush=True)
            return _STOPPED
        print(f"sweep process exited with {rc}: resuming after the op it was running",
              flush=True)
        resume = died = True
    records = load(a.log)
    out = a.results or (RESULTS if a.full else None)
    if out:  # --full reports the summary's op runs too
        write_results(logged(a.log, a.summary if a.full else None),
                      "python -m tests.fidelity.opinfo " + " ".join(
            argv if argv is not None else sys.argv[1:]), out, time.time() - start)
        print(f"wrote {out}")
    failed = [r for r in records if r["status"] in ("mismatch", "crash", "silent")]
    print(f"{len(records)} samples, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
