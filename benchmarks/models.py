"""Real models under the engine: launches, divergences and step time against eager, per model.

    python benchmarks/models.py [--models llama,gpt2] [--steps 200] [--size issue]
                                [--slope 1000] [--generate]

For each model of benchmarks/zoo.py (HF Transformers, random weights, no download) and each
backend it trains ``--steps`` steps and reports: aten ops per step, launches per step once
hot, divergences in the last half, and the median step time of the last half against eager
measured in this same process before and after each engine run (ratios against the mean of
the two, not absolute times: this machine drifts by tens of percent). Two engine figures per
backend:

* ``hot``: the step governor off (``NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO=0``), timed after
  10 steps and the background compile: what a hot replay costs;
* ``default``: the governor on: where the engine is slower it steps aside (plain eager),
  counted in ``aside`` (Note [Stepping aside] in adaptive_eager/governor.py).

``--slope N`` trains the Llama N steps under ``exact`` (governor off) and fits step time
against step index: the slope shows work that grows with history. ``--generate`` times
greedy ``generate(max_new_tokens=16)`` (dynamic and static cache) against eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager.engine import ENGINE  # noqa: E402
from benchmarks.zoo import MODELS, build, train_step  # noqa: E402

DIVERGED = "diverged from the hot path"


def eager_run(name, size, steps):
    step = train_step(*build(name, size))
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def engine_run(name, size, steps, backend, governor: bool):
    os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "1.05" if governor else "0"
    ae.reset()
    step = train_step(*build(name, size))
    rows = []
    with ae.enabled(devices=("cpu",), backend=backend):
        if not governor:  # the hot figure: measured once the fused graph is in use
            for _ in range(10):
                step()
            ENGINE.wait_compiles(600)
        for _ in range(steps):
            s0 = ae.stats()
            t = time.perf_counter()
            step()
            dt = time.perf_counter() - t
            s1 = ae.stats()
            rows.append((dt, s1.launches - s0.launches, s1.ops_intercepted - s0.ops_intercepted,
                         s1.fallbacks.get(DIVERGED, 0) - s0.fallbacks.get(DIVERGED, 0),
                         s1.steps_suspended - s0.steps_suspended))
    ENGINE.wait_compiles(600)
    last = rows[steps // 2:]
    return dict(
        time=statistics.median(r[0] for r in last),
        launches=max(r[1] for r in last[-10:]),
        ops=max(r[2] for r in rows[steps // 2:]),
        div=sum(r[3] for r in last),
        aside=sum(r[4] for r in rows),
    )


def table(args):
    print(f"models on cpu, size {args.size}, {args.steps} steps per run, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; times: median of the last half, vs eager")
    print(f"{'model':9s} {'ops/step':>8s} {'backend':8s} {'launches':>8s} {'div':>4s} "
          f"{'eager ms':>8s} {'hot ms':>7s} {'hot/eager':>9s} {'default/eager':>13s} {'aside':>5s}")
    for name in args.models:
        for backend in ("exact", "inductor"):
            # eager before and after each engine run: each ratio is against the mean of its
            # two neighbours, which takes out most of the machine's slow drift
            e0 = eager_run(name, args.size, 60)
            hot = engine_run(name, args.size, args.steps, backend, governor=False)
            e1 = eager_run(name, args.size, 60)
            dflt = engine_run(name, args.size, args.steps, backend, governor=True)
            e2 = eager_run(name, args.size, 60)
            eager, eager2 = (e0 + e1) / 2, (e1 + e2) / 2
            print(f"{name:9s} {hot['ops']:8d} {backend:8s} {hot['launches']:8d} {hot['div']:4d} "
                  f"{eager * 1e3:8.2f} {hot['time'] * 1e3:7.2f} {hot['time'] / eager:8.2f}x "
                  f"{dflt['time'] / eager2:12.2f}x {dflt['aside']:5d}", flush=True)


def slope(args):
    os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "0"
    ae.reset()
    step = train_step(*build("llama", args.size))
    times = []
    with ae.enabled(devices=("cpu",), backend="exact"):
        for _ in range(args.slope):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    xs = list(range(20, len(times)))  # after warm-up
    ys = [times[i] for i in xs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    q = len(ys) // 4
    print(f"llama exact, {args.slope} steps: median step {statistics.median(ys) * 1e3:.2f} ms; "
          f"slope {b * 1e9:.1f} ns per step per step ({b * len(xs) / my * 100:+.1f}% over the "
          f"run); first quarter {statistics.median(ys[:q]) * 1e3:.2f} ms, last quarter "
          f"{statistics.median(ys[-q:]) * 1e3:.2f} ms")


def generate(args):
    model, batch = build("llama", args.size)
    model.eval()
    ids = batch["input_ids"][:1, :8]
    for cache in ("dynamic", "static"):
        kw = dict(max_new_tokens=16, do_sample=False)
        if cache == "static":
            kw["cache_implementation"] = "static"
        ref = model.generate(ids, **kw)
        for governor in (False, True):
            os.environ["NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO"] = "1.05" if governor else "0"
            times = {"eager": [], "engine": []}
            for _ in range(3):
                model.generate(ids, **kw)
            for _ in range(10):
                t = time.perf_counter()
                model.generate(ids, **kw)
                times["eager"].append(time.perf_counter() - t)
            ae.reset()
            same = True
            with ae.enabled(devices=("cpu",), backend="exact"):
                for _ in range(10):
                    same &= torch.equal(model.generate(ids, **kw), ref)
                s0 = ae.stats()
                for _ in range(10):
                    t = time.perf_counter()
                    same &= torch.equal(model.generate(ids, **kw), ref)
                    times["engine"].append(time.perf_counter() - t)
                s1 = ae.stats()
            e, x = statistics.median(times["eager"]), statistics.median(times["engine"])
            print(f"generate 16 tokens, {cache} cache, governor {'on ' if governor else 'off'}: "
                  f"same tokens {same}; eager {e * 1e3:.1f} ms, engine (exact) {x * 1e3:.1f} ms "
                  f"({x / e:.2f}x); per call: launches {(s1.launches - s0.launches) / 10:.0f}, "
                  f"replays {(s1.replays - s0.replays) / 10:.0f}, steps aside "
                  f"{(s1.steps_suspended - s0.steps_suspended) / 10:.1f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--size", default="issue", choices=("issue", "tiny"))
    p.add_argument("--slope", type=int, default=0)
    p.add_argument("--generate", action="store_true")
    p.add_argument("--no-table", action="store_true")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown model {bad[0]!r}; accepted: {', '.join(MODELS)}")
    if args.steps < 20:
        p.error(f"--steps {args.steps} is too few; accepted: 20 or more")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if not args.no_table:
        table(args)
    if args.slope:
        slope(args)
    if args.generate:
        generate(args)


if __name__ == "__main__":
    main()
