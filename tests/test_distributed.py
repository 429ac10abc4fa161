"""torch.distributed under the engine: ranks on loopback (gloo; on neuron the device's own
backend), each run against plain eager.

Each test starts its ranks in a fresh process group (``torch.multiprocessing.spawn``), under a
timeout, so a rank that fails or hangs fails the test and leaves no process behind.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import child_env

pytest.importorskip("torch.distributed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each rank trains the same model from the same seed: plainly, on cpu too where the device is
# neuron, and under the engine with each backend; rank 0 prints what the test compares.
TRAIN = textwrap.dedent('''
    import contextlib, json, sys
    import torch, torch.distributed as dist, torch.nn as nn
    import adaptive_eager as ae
    from torch.distributed.device_mesh import init_device_mesh

    STEPS = 10

    def build(rank, world, device, cfg):
        torch.manual_seed(0)
        kind = cfg["kind"]
        if kind == "tp":  # a tiny Llama's MLPs split across the ranks; the same batch on each
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)
            from transformers import LlamaConfig, LlamaForCausalLM

            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64)).to(device)
            mesh = init_device_mesh(device, (world,))
            for layer in model.model.layers:
                parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(),
                                                     "up_proj": ColwiseParallel(),
                                                     "down_proj": RowwiseParallel()})
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
            ids = ids.to(device)
            # one tensor at a time: foreach kernels refuse a mix of DTensor and plain tensors
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            return model, opt, lambda: model(input_ids=ids, labels=ids).loss
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device)
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kw = dict(reshard_after_forward=cfg["reshard"], mesh=init_device_mesh(device, (world,)))
            if cfg["bf16"]:
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, **kw)
            fully_shard(model, **kw)
        g = torch.Generator().manual_seed(1 + rank)
        x, y = torch.randn(4, 16, generator=g).to(device), torch.randn(4, 8, generator=g).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, lambda: ((model(x).float() - y) ** 2).mean()

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().float().cpu()

    def train(rank, world, device, backend, cfg):
        model, opt, loss_of = build(rank, world, device, cfg)
        ctx = (ae.enabled(devices=(device,), backend=backend) if backend
               else contextlib.nullcontext())
        losses = []
        with ctx:
            for i in range(STEPS):
                loss = loss_of()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if backend == "inductor" and i == 2:
                    ae.wait_compiles(240)  # the later steps replay fused graphs
        state = [local(p) for p in model.parameters()]
        state += [local(v) for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim()]
        return losses, state

    def compare(a, b):
        return dict(
            losses_equal=a[0] == b[0],
            state_equal=all(torch.equal(x, y) for x, y in zip(a[1], b[1])),
            losses_close=all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(a[0], b[0])),
            state_close=all(torch.allclose(x, y, rtol=1e-3, atol=1e-5)
                            for x, y in zip(a[1], b[1])))

    def main(rank, world, port, cfg):
        device = cfg["device"]
        if device == "neuron":  # else FSDP2 and DeviceMesh would pick the accelerator
            import adaptive_eager.neuron
        dist.init_process_group("cpu:gloo,neuron:gloo" if device == "neuron" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            want = train(rank, world, device, None, cfg)
            out = {}
            if device == "neuron":
                out["cpu"] = compare(want, train(rank, world, "cpu", None, cfg))
            for backend in cfg["backends"]:
                ae.reset()
                r = compare(want, train(rank, world, device, backend, cfg))
                s = ae.stats()
                r.update(replays=s.replays, fused=s.cache_hits,
                         resizes=s.boundaries.get("storage resize", 0))
                out[backend] = r
            if rank == 0:
                print("RESULT " + json.dumps(out), flush=True)
        finally:
            dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        cfg = json.loads(sys.argv[2])
        mp.spawn(main, args=(cfg["world"], int(sys.argv[1]), cfg), nprocs=cfg["world"])
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, *args, tmp_path) -> dict:
    path = tmp_path / "ranks.py"
    path.write_text(script)
    env = child_env(NEURON_ADAPTIVE_EAGER_SUSPEND_RATIO="0", NEURON_ADAPTIVE_EAGER_RETIRE_RATIO="0",
                    PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # start_new_session: on a timeout the whole group of ranks is killed with it
    p = subprocess.Popen([sys.executable, str(path), str(_free_port()), *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        pytest.fail("the ranks did not finish in 240 s")
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, f"ranks failed:\n{err[-3000:]}"
    return json.loads(line[len("RESULT "):])


BOTH = ("exact", "inductor")
CASES = {  # id: (kind, device, ranks, backends, FSDP2's reshard_after_forward, bf16 parameters)
    "ddp-cpu": ("ddp", "cpu", 2, BOTH, True, False),
    "ddp-cpu-4-ranks": ("ddp", "cpu", 4, ("exact",), True, False),
    "ddp-neuron": ("ddp", "neuron", 2, BOTH, True, False),
    "fsdp2-cpu": ("fsdp2", "cpu", 2, BOTH, True, False),
    "fsdp2-cpu-no-reshard": ("fsdp2", "cpu", 2, ("exact",), False, False),
    "fsdp2-cpu-4-ranks-bf16": ("fsdp2", "cpu", 4, ("exact",), True, True),
    "fsdp2-neuron": ("fsdp2", "neuron", 2, BOTH, True, False),
    "fsdp2-neuron-bf16": ("fsdp2", "neuron", 2, ("exact",), True, True),
    "tp-cpu": ("tp", "cpu", 2, BOTH, True, False),
    "tp-cpu-4-ranks": ("tp", "cpu", 4, ("exact",), True, False),
    "tp-neuron": ("tp", "neuron", 2, BOTH, True, False),
}


@pytest.mark.parametrize("case", CASES)
def test_trains_as_eager(tmp_path, case):
    # The FSDP2 cases are the regression tests of Note [Storage resizes]: a deferred op read
    # an unsharded parameter after FSDP2 freed its memory ("data is not allocated yet"). On
    # neuron the frees after backward run on autograd's device thread.
    kind, device, world, backends, reshard, bf16 = CASES[case]
    if kind == "tp":
        pytest.importorskip("transformers")
    cfg = dict(kind=kind, device=device, world=world, backends=backends, reshard=reshard,
               bf16=bf16)
    r = _run(TRAIN, json.dumps(cfg), tmp_path=tmp_path)
    if device == "neuron":  # plain eager on the device: bitwise cpu's
        assert r["cpu"]["losses_equal"] and r["cpu"]["state_equal"]
    for backend in backends:
        got = r[backend]
        if backend == "exact":  # bitwise: losses every step, parameters, optimizer state
            assert got["losses_equal"] and got["state_equal"], got
        else:
            assert got["losses_close"] and got["state_close"], got
            assert got["fused"] > 0, got  # fused graphs replayed
        assert got["replays"] > 0, got  # the engine went hot, not aside
        if kind == "fsdp2" and reshard:
            assert got["resizes"] > 0, got


# Note [Collectives over device memory] (adaptive_eager/neuron/collectives.py)
NEURON_DDP = textwrap.dedent('''
    import contextlib, json, sys
    import torch, torch.distributed as dist, torch.nn as nn
    import adaptive_eager as ae
    import adaptive_eager.neuron

    def collectives(rank):
        torch.manual_seed(rank)
        x = torch.randn(6)
        got, want = x.to("neuron") * 2, x * 2
        out = []
        for t in (got, want):
            dist.all_reduce(t)
            gathered = torch.empty(12, device=t.device)
            dist.all_gather_into_tensor(gathered, t)
            part = torch.empty(3, device=t.device)
            dist.reduce_scatter_tensor(part, t)
            b = torch.full((4,), float(rank), device=t.device)
            dist.broadcast(b, src=1)
            dist.all_reduce(b, async_op=True).wait()
            out.append([v.cpu().tolist() for v in (t, gathered, part, b)])
        return out[0] == out[1]

    def mixed(rank, device, engine):
        """Compute and collectives interleaved in a loop: in-place, async with wait(),
        functional (with its wait), and reads of what they wrote."""
        import torch.distributed._functional_collectives as funcol

        torch.manual_seed(rank)
        x = torch.randn(8).to(device)
        ctx = ae.enabled(devices=(device,), backend="exact") if engine else contextlib.nullcontext()
        seen = []
        with ctx:
            for i in range(8):
                a = x * (i + 1) + 1
                work = dist.all_reduce(a, async_op=True)
                work.wait()
                b = funcol.all_reduce(a * 2, "sum", dist.group.WORLD)
                c = funcol.wait_tensor(b) + a
                out = torch.empty(16, device=device)
                dist.all_gather_into_tensor(out, c.tanh())
                x = x + out[:8] * 0.01
                seen.append((x.sum() + c.sum()).item())
        return seen

    def train(rank, device, engine):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        torch.manual_seed(1 + rank)
        x, y = torch.randn(4, 16).to(device), torch.randn(4, 8).to(device)
        ctx = ae.enabled(devices=(device,), backend="exact") if engine else contextlib.nullcontext()
        losses = []
        with ctx:
            for _ in range(10):
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    def main(rank, world, port, backend):
        dist.init_process_group(backend or None, init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        try:
            same = collectives(rank)
            loops = [mixed(rank, d, e) for d in ("cpu", "neuron") for e in (False, True)]
            cpu, neuron = train(rank, "cpu", False), train(rank, "neuron", False)
            engine_cpu = train(rank, "cpu", True)
            ae.reset()
            engine = train(rank, "neuron", True)
            s = ae.stats()
            if rank == 0:
                print("RESULT " + json.dumps(dict(
                    backend=dist.group.WORLD._get_backend(torch.device("neuron")).name(),
                    collectives_same=same, loops=loops, cpu=cpu, engine_cpu=engine_cpu,
                    neuron=neuron, engine=engine, replays=s.replays,
                    collectives=sum(n for k, n in s.fallbacks.items()
                                    if k.startswith("collective: c10d.")))), flush=True)
        finally:
            dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
''')


@pytest.mark.parametrize("backend", ["", "gloo"], ids=["default", "gloo"])
def test_collectives_and_ddp(tmp_path, backend):
    r = _run(NEURON_DDP, backend, tmp_path=tmp_path)
    assert r["backend"] == "gloo"  # the device's default, and gloo named: gloo serves it
    assert r["collectives_same"]  # all_reduce, all_gather, reduce_scatter, broadcast: as cpu
    # compute and collectives interleaved (async with wait(), functional ones): the engine on
    # each device as eager there, and neuron as cpu
    cpu_eager, cpu_engine, neuron_eager, neuron_engine = r["loops"]
    assert cpu_engine == cpu_eager and neuron_engine == neuron_eager == cpu_eager
    assert r["neuron"] == r["cpu"]  # DDP on the device, plain eager: bitwise cpu's
    assert r["engine"] == r["neuron"]  # and under the engine
    assert r["engine_cpu"] == r["cpu"]  # as on cpu
    assert r["replays"] > 0
    # DDP's bucket all-reduces run in backward hooks, on autograd's device thread: each
    # launched what the engine deferred first (else they reduced gradients not yet computed)
    assert r["collectives"] > 0


# One rank fails mid-training under the engine; the other must raise too, not hang. Each rank
# writes what happened to it; the parent gives them a bounded time and kills what is left.
FAILING_RANK = textwrap.dedent('''
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist, torch.nn as nn
    import adaptive_eager as ae

    def main(rank, world, port, device, outdir):
        if device == "neuron":
            import adaptive_eager.neuron
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(16, 8).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 16).to(device)
        start = time.time()
        try:
            with ae.enabled(devices=(device,), backend="exact"):
                for i in range(20):
                    if rank == 1 and i == 6:  # hot by now
                        raise RuntimeError("rank 1 fails")
                    loss = model(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    loss.item()
            what = "finished"
        except Exception as e:
            what = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(what=what, seconds=time.time() - start), f)
        os._exit(0)  # no process-group teardown: the peer is gone

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        ctx = mp.start_processes(main, args=(2, int(sys.argv[1]), sys.argv[2], sys.argv[3]),
                                 nprocs=2, join=False, start_method="spawn")
        deadline = time.time() + 120
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.time()))
        alive = [p.pid for p in ctx.processes if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        ranks = []
        for r in range(2):
            path = os.path.join(sys.argv[3], f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else None)
        print("RESULT " + json.dumps(dict(alive=alive, ranks=ranks)), flush=True)
''')


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_a_failing_rank_raises_on_every_rank(tmp_path, device):
    out = tmp_path / "ranks"
    out.mkdir()
    r = _run(FAILING_RANK, device, str(out), tmp_path=tmp_path)
    assert r["alive"] == []  # no rank left hanging
    failed, survivor = r["ranks"][1], r["ranks"][0]
    assert failed["what"] == "raised RuntimeError: rank 1 fails"
    # the other rank's next collective fails as its peer goes away, well inside the timeout
    assert survivor["what"].startswith("raised "), survivor
    assert survivor["seconds"] < 60
