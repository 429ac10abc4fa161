"""Warm start (Note [Warm start], Note [The warm-start store]): a second process replays what
the first learned, safely. Each run is a fresh process on a script of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from adaptive_eager.scheduler.disk_cache import Store, StoreRefused

PROGRAM = r'''
import json, os, sys
import torch
import adaptive_eager as ae

if os.environ.get("DROPOUT"):
    torch.manual_seed(1)
ae.enable(devices=("cpu",), backend=os.environ["BACKEND"])
# the generator as the program left it before enabling (restoring must not move it)
probe = torch.rand(()).item() if os.environ.get("DROPOUT") else None
torch.manual_seed(0)
w = torch.randn(16, 16, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.01)
x = torch.randn(8, 16)
act = torch.sigmoid if os.environ.get("CHANGED") else torch.tanh
steps = []
for i in range(int(os.environ.get("STEPS", "6"))):
    before = ae.stats()
    h = x @ w
    if os.environ.get("DROPOUT"):
        h = torch.nn.functional.dropout(h, 0.5)
    out = act(h)
    loss = out.sum()
    if not (os.environ.get("HOLD") and i < 3):
        del out  # held through step 2 (where the path warms), not after: another variant
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.item()
    after = ae.stats()
    steps.append(dict(loss=value, eager=after.ops_eager - before.ops_eager,
                      replays=after.replays - before.replays))
    if os.environ.get("WAIT") and i == 2:
        ae.wait_compiles()
if os.environ.get("WAIT"):
    ae.wait_compiles()
s = ae.stats()
report = ae.explain()
print(json.dumps(dict(steps=steps, probe=probe, restored=s.paths_restored, loaded=s.graphs_loaded,
                      compiled=s.graphs_compiled, fallbacks=s.fallbacks,
                      info=ae.cache_info(),
                      explain=[p.why for p in report.paths if p.state == "hot"])))
'''


def _run(script, cache, backend="exact", **env):
    e = dict(os.environ, NEURON_ADAPTIVE_EAGER_WARM_START="1",
             NEURON_ADAPTIVE_EAGER_CACHE_DIR=str(cache), BACKEND=backend)
    e.update({k: str(v) for k, v in env.items()})
    p = subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.fixture
def program(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    return script, tmp_path / "cache"


def test_a_second_process_replays_a_path_the_first_learned_without_recording_it(program):
    script, cache = program
    first, _ = _run(script, cache)
    second, _ = _run(script, cache)
    assert first["restored"] == 0 and second["restored"] >= 1
    # the first run records the step (eager ops) for hot_threshold steps; the second
    # replays from its second step at the latest, and records nothing of the known step
    assert sum(s["eager"] for s in first["steps"][1:3]) > 0
    assert second["steps"][1]["replays"] >= 1
    # the first step too: the first run kept it though it never recurred there
    assert all(s["eager"] == 0 and s["replays"] >= 1 for s in second["steps"])
    assert [s["loss"] for s in second["steps"]] == [s["loss"] for s in first["steps"]]
    assert any("from the warm-start cache" in why for why in second["explain"])
    info = second["info"]
    assert info["enabled"] and info["paths"] >= 1 and info["reads"] >= 1
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"


def test_a_changed_program_relearns(program):
    script, cache = program
    _run(script, cache)
    changed, _ = _run(script, cache, CHANGED=1)
    eager, _ = _run(script, cache / "elsewhere", CHANGED=1, NEURON_ADAPTIVE_EAGER_WARM_START=0)
    # the kept path was restored, did not match the running program, and the program
    # learned its own: values as without the engine's cache
    assert changed["restored"] >= 1
    assert [s["loss"] for s in changed["steps"]] == [s["loss"] for s in eager["steps"]]
    assert any(s["eager"] > 0 for s in changed["steps"][1:3])  # recorded anew
    assert changed["steps"][-1]["replays"] >= 1 and changed["steps"][-1]["eager"] == 0


def test_an_edited_source_is_not_restored(program):
    script, cache = program
    _run(script, cache)
    script.write_text(PROGRAM + "\n# edited: its lines may have moved\n")
    edited, _ = _run(script, cache)
    assert edited["restored"] == 0
    assert any("its source changed" in r for r in edited["fallbacks"])


def test_a_fused_graph_is_loaded_not_compiled(program):
    script, cache = program
    # with dropout: the graphs draw random numbers, and the second run's restore runs each
    # loaded graph once on zeros (warm._rehearse), which must not move the generator. HOLD:
    # the step's path warms with one more output alive than its later launches have, so it
    # has two variants, the second requested after its record was first written
    first, _ = _run(script, cache, backend="inductor", WAIT=1, DROPOUT=1, HOLD=1)
    assert first["compiled"] == 2 and first["loaded"] == 0
    second, _ = _run(script, cache, backend="inductor", WAIT=1, DROPOUT=1, HOLD=1)
    assert second["probe"] == first["probe"]
    # the step's two graphs (its record written again at exit names both), and those of the
    # paths seen once (the first step's, the probe's), compiled at the first run's exit
    # (Note [Warm start]): every step replays fused, nothing compiles
    assert second["restored"] >= 2 and second["loaded"] == 4 and second["compiled"] == 0
    assert all(s["replays"] >= 1 and s["eager"] == 0 for s in second["steps"])
    assert not any("replayed exactly" in r for r in second["fallbacks"]), second["fallbacks"]
    for a, b in zip(first["steps"], second["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_corrupted_and_foreign_entries_are_ignored_and_reported(program):
    script, cache = program
    first, _ = _run(script, cache, backend="inductor", WAIT=1)
    files = sorted(str(p) for p in cache.rglob("*.ae"))
    records = [f for f in files if "paths-" in f]
    # the step's record and its graph, and the first step's record and graph (seen once,
    # compiled at exit: Note [Warm start])
    assert len(files) == 4 and len(records) == 2
    for f in files:
        data = bytearray(open(f, "rb").read())
        data[-5] ^= 0xFF  # a flipped byte
        open(f, "wb").write(bytes(data))
    # the later runs stop before the step recurs and compile nothing at exit: only the
    # restore to try
    again, err = _run(script, cache, backend="inductor", STEPS=2,
                      NEURON_ADAPTIVE_EAGER_CACHE_EXIT_S=0)
    # one line per record; the graph is never reached
    assert err.count("warm-start cache entry") == 2
    assert err.count("ignored: its checksum does not match") == 2
    assert again["restored"] == 0 and again["info"]["rejected"] == 2
    assert [s["loss"] for s in again["steps"]] == [s["loss"] for s in first["steps"][:2]]
    # an entry copied under another name (another path's) fails its check too
    for record in [p for p in cache.rglob("*.ae") if "paths-" in str(p)]:
        foreign = record.with_name("f" + record.name[1:])
        foreign.write_bytes(record.read_bytes())
        record.unlink()
    third, err = _run(script, cache, backend="inductor", STEPS=2,
                      NEURON_ADAPTIVE_EAGER_CACHE_EXIT_S=0)
    assert err.count("ignored: its checksum does not match") == 2 and third["restored"] == 0


def test_a_directory_others_can_write_is_refused(program):
    script, cache = program
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    out, err = _run(script, cache)
    assert "not used" in err and "writable by its group or others" in err
    assert out["info"]["enabled"] is False and out["restored"] == 0
    assert not list(cache.rglob("*.ae"))


def test_cache_clear_and_info(program, tmp_path):
    script, cache = program
    _run(script, cache)
    code = ("import adaptive_eager as ae, json; i = ae.cache_info(); n = ae.cache_clear(); "
            "print(json.dumps([i['files'], n, ae.cache_info()['files']]))")
    e = dict(os.environ, NEURON_ADAPTIVE_EAGER_WARM_START="1",
             NEURON_ADAPTIVE_EAGER_CACHE_DIR=str(cache), NEURON_ADAPTIVE_EAGER_DEVICES="cpu")
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                       timeout=300)
    before, removed, after = json.loads(p.stdout.strip().splitlines()[-1])
    assert before >= 1 and removed == before and after == 0


# ---------------------------------------------------------------- the store


def test_concurrent_writers_leave_whole_files(tmp_path):
    st = Store(str(tmp_path / "c"), "env", 1 << 30)
    payloads = [bytes([i]) * (200_000 + i) for i in range(8)]
    errors = []

    def write(i):
        try:
            for _ in range(20):
                st.write("k", "same", payloads[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def read():
        for _ in range(200):
            data = st.read("k", "same")
            if data is not None and data not in payloads:
                errors.append("torn read")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and st.read("k", "same") in payloads and st.rejected == 0
    assert [p.name for p in (tmp_path / "c" / "env" / "k").iterdir()] == ["same.ae"]


def test_the_store_is_bounded_least_recently_used_first(tmp_path):
    st = Store(str(tmp_path / "c"), "env", 250_000)
    for name in ("a", "b"):
        st.write("k", name, b"x" * 100_000)
    os.utime(st._file("k", "a"), (1, 1))
    os.utime(st._file("k", "b"), (2, 2))
    assert st.read("k", "a") is not None  # a read makes "a" the most recently used
    st.write("k", "c", b"x" * 100_000)
    assert st.names("k") == ["a", "c"] and st.evicted == 1


def test_an_entry_of_another_environment_fails_its_check(tmp_path):
    mine = Store(str(tmp_path / "c"), "env1", 1 << 20)
    other = Store(str(tmp_path / "c"), "env2", 1 << 20)
    mine.write("k", "x", b"payload")
    os.makedirs(os.path.dirname(other._file("k", "x")), exist_ok=True)
    with open(mine._file("k", "x"), "rb") as f, open(other._file("k", "x"), "wb") as g:
        g.write(f.read())
    assert mine.read("k", "x") == b"payload"
    assert other.read("k", "x") is None and other.rejected == 1


def test_a_root_owned_elsewhere_or_open_to_others_is_refused(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o775)
    with pytest.raises(StoreRefused, match="writable by its group or others"):
        Store(str(root), "env", 1 << 20)


def test_a_path_seen_once_replays_at_its_first_occurrence_and_warms_when_it_recurs(program):
    script, cache = program
    # its path ends once; the exit compiles nothing (a graph compiled at exit is loaded
    # instead: test_a_fused_graph_is_loaded_not_compiled)
    once, _ = _run(script, cache, backend="inductor", STEPS=1,
                   NEURON_ADAPTIVE_EAGER_CACHE_EXIT_S=0)
    assert once["steps"][0]["replays"] == 0 and once["compiled"] == 0
    second, _ = _run(script, cache, backend="inductor", WAIT=1)
    # replayed exactly at its first occurrence, as a path seen in an earlier run, then
    # warmed as any path once it recurred here: compiled, fused, no longer "seen before"
    assert second["restored"] >= 1 and second["steps"][0]["replays"] >= 1
    assert second["steps"][0]["eager"] == 0
    assert any("seen in an earlier run" in r for r in second["fallbacks"])
    assert second["compiled"] >= 1 and second["steps"][-1]["eager"] == 0
    # the step's path, promoted (a first step's own path, which never recurs, stays as seen)
    assert any("seen in an earlier run" not in why for why in second["explain"]), \
        second["explain"]
