"""The sweep's durable record: one line per finished op run, kept in the repository.

The sweep's JSON-lines logs hold every sample (tens of megabytes for the whole database) and
stay out of git; a session that ends loses them, and with them hours of machine time. So the
sweep folds what its logs hold into ``sweep_summary.jsonl`` (``--compact``): per op run
(op x device x backend x dtype x kind) the samples per status, the fallback reasons, the
failures, the ops noted as differing under any dispatch mode or from the cpu. The report
(RESULTS.md) and ``--resume`` read that file and the logs together; where both hold an op
run, the logs' (newer) one counts.

Note [Sweep summary]: a summary line is the sum over an op run's samples, so summing lines
per (device, backend, dtype, kind) gives the report's row exactly as the samples would; it
keeps the first 300 characters of each failure's detail, which is what the report shows.
"""

from __future__ import annotations

import collections
import datetime
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = os.path.join(HERE, "sweep_summary.jsonl")
FAILED = ("mismatch", "crash", "silent")
NOTED = ("dispatch-mode", "eager-nondeterministic")


def key(op_name, device, backend, dtype, kind) -> str:
    return f"{device}|{backend}|{dtype}|{kind}|{op_name}"


def _status(rec) -> str:
    status = rec["status"]
    if status in FAILED and rec.get("device_diff"):
        return "device-bug"  # as run_op judges it (logs written before it did)
    return status


def of_records(records) -> dict[str, dict]:
    """Per op run, the summary line of its sample records."""
    out: dict[str, dict] = {}
    for r in records:
        k = key(r["op"], r["device"], r["backend"], r["dtype"], r["kind"])
        line = out.get(k)
        if line is None:
            line = out[k] = dict(op=r["op"], device=r["device"], backend=r["backend"],
                                 dtype=r["dtype"], kind=r["kind"], counts={}, reasons={},
                                 failures=[], device_diff=0,
                                 date=datetime.date.today().isoformat())
        status = _status(r)
        line["counts"][status] = line["counts"].get(status, 0) + 1
        if status in FAILED:
            line["failures"].append(f"{status}: {r['detail']}"[:300])
        for reason in r["reasons"]:
            line["reasons"][reason] = line["reasons"].get(reason, 0) + 1
        if r.get("device_diff") or status == "device-bug":
            line["device_diff"] += 1
    return out


def read(path: str = SUMMARY) -> dict[str, dict]:
    """The summary lines of ``path`` by op run (none when it does not exist)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return {key(x["op"], x["device"], x["backend"], x["dtype"], x["kind"]): x for x in lines}


def write(lines: dict[str, dict], path: str = SUMMARY) -> None:
    """Write atomically, sorted by op run, so that the file diffs line by line in git."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for k in sorted(lines):
            f.write(json.dumps(lines[k], sort_keys=True) + "\n")
    os.replace(tmp, path)


def merged(lines: dict[str, dict], empty_runs, records) -> dict[str, dict]:
    """``lines`` with the op runs of the logs laid over them: ``empty_runs`` are keys of runs
    the logs finished with no sample, ``records`` those runs' samples."""
    out = dict(lines)
    for k in empty_runs:
        device, backend, dtype, kind, op = k.split("|", 4)
        out[k] = dict(op=op, device=device, backend=backend, dtype=dtype, kind=kind, counts={},
                      reasons={}, failures=[], device_diff=0,
                      date=datetime.date.today().isoformat())
    out.update(of_records(records))
    return out


def table(lines) -> dict:
    """Per (device, backend, dtype, kind): the report's counts, reasons and per-op lists."""
    rows = collections.defaultdict(lambda: dict(
        run=0, identical=0, fallback=0, host=0, no_op=0, dispatch_mode=0,
        eager_nondeterministic=0, device_bug=0, eager_error=0, skipped=0, failed=0,
        device_diff=0, reasons=collections.Counter(), failures=collections.defaultdict(list),
        device_ops=collections.Counter(),
        noted=collections.defaultdict(collections.Counter)))
    for x in lines:
        row = rows[(x["device"], x["backend"], x["dtype"], x["kind"])]
        for status, n in x["counts"].items():
            row["run"] += n
            if status in FAILED:
                row["failed"] += n
            else:
                row[status.replace("-", "_")] += n
            if status in NOTED:
                row["noted"][status][x["op"]] += n
        if x["failures"]:
            row["failures"][x["op"]] += x["failures"]
        row["reasons"].update(x["reasons"])
        if x["device_diff"]:
            row["device_diff"] += x["device_diff"]
            row["device_ops"][x["op"]] += x["device_diff"]
    return rows
