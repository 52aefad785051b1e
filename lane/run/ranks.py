"""R ranks as R processes on this machine: the launcher (`launch`), the communicators a rank meets the others through
(`GlooComm`: torch.distributed's gloo on the CPU; `NcclComm`: NCCL through CuPy on GPUs, imported when made) and a
rank's greedy run (`rank_generate`: its step graphs, engine/front/parallel.py, run by the reference interpreter with its
communicator). Every collective waits at most `timeout` seconds: a rank that dies ends every rank, and the launcher
says which, in one line."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import numpy as np

from lanefuse.engine.collectives import combine
from lanefuse.engine.errors import UserError, clip

TIMEOUT_S = 60.0  # the longest a collective waits for the other ranks


def gloo_missing() -> str | None:
    """Why the gloo backend cannot run here, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install -e '.[hf]': torch's gloo runs the CPU ranks)"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no gloo backend (torch.distributed.is_gloo_available() is False)"
    return None


class GlooComm:
    """A rank's communicator over torch.distributed's gloo (the process group already made). `exact`: each collective
    gathers every rank's payload and combines them as engine/collectives.combine does (the reference interpreter's
    bits: the sum in f64 in rank order); else the all-reduce is gloo's own (its order of f32 sums: within f32
    rounding of the reference)."""

    def __init__(self, rank: int, ranks: int, exact: bool = True):
        self.rank, self.ranks, self.exact = rank, ranks, exact
        self.calls = 0  # collectives met (a census of the run)
        self.bytes = 0  # payload bytes this rank sent

    def exchange(self, kind: str, x: np.ndarray) -> list[np.ndarray]:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.ascontiguousarray(x))
        got = [torch.empty_like(t) for _ in range(self.ranks)]
        dist.all_gather(got, t)
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        return [g.numpy() for g in got]

    def __getattr__(self, name: str):
        if name == "all_reduce" and not self.__dict__.get("exact", True):
            return self._all_reduce
        raise AttributeError(name)

    def _all_reduce(self, x: np.ndarray) -> np.ndarray:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.array(x, dtype=np.float32))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        self.calls += 1
        self.bytes += t.numel() * 4
        return t.numpy()


class NcclComm:
    """A rank's communicator over NCCL through CuPy (`cupy.cuda.nccl`), for ranks a GPU each: the payloads gathered
    on the device (ncclAllGather), combined as engine/collectives.combine does; an all-reduce NCCL's own (ncclAllReduce,
    f32 sum). The NCCL id is passed from rank 0 through the process group's store (torch.distributed, any backend).
    CuPy is imported here, when one is made."""

    def __init__(self, rank: int, ranks: int, exact: bool = True):
        import cupy
        import torch.distributed as dist
        from cupy.cuda import nccl

        self.rank, self.ranks, self.exact, self.calls, self.bytes = rank, ranks, exact, 0, 0
        self.cp, self.nccl = cupy, nccl
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        uid = [nccl.get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=0)
        self.comm = nccl.NcclCommunicator(ranks, uid[0], rank)

    def exchange(self, kind: str, x: np.ndarray) -> list[np.ndarray]:
        cp, nccl = self.cp, self.nccl
        src = cp.asarray(np.ascontiguousarray(x))
        dst = cp.empty((self.ranks,) + src.shape, dtype=src.dtype)
        dtype = nccl.NCCL_FLOAT64 if src.dtype == np.float64 else nccl.NCCL_FLOAT32
        self.comm.allGather(src.data.ptr, dst.data.ptr, src.size, dtype, cp.cuda.get_current_stream().ptr)
        self.calls += 1
        self.bytes += src.nbytes
        host = cp.asnumpy(dst)
        return [host[r] for r in range(self.ranks)]

    def __getattr__(self, name: str):
        if name == "all_reduce" and not self.__dict__.get("exact", True):
            return self._all_reduce
        raise AttributeError(name)

    def _all_reduce(self, x: np.ndarray) -> np.ndarray:
        cp, nccl = self.cp, self.nccl
        buf = cp.asarray(np.array(x, dtype=np.float32))
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                            cp.cuda.get_current_stream().ptr)
        self.calls += 1
        self.bytes += buf.nbytes
        return cp.asnumpy(buf)


def check_combines(comm) -> None:
    """A communicator's exchange agrees with engine/collectives.combine on a known payload (a smoke check a rank can
    run before its first step)."""
    x = np.full((1, 3), comm.rank + 1, dtype=np.float32)
    got = combine("all_reduce", comm.exchange("all_reduce", x))
    want = np.full((1, 3), comm.ranks * (comm.ranks + 1) / 2, dtype=np.float32)
    if not np.array_equal(got, want):
        raise UserError(f"rank {comm.rank}: the communicator's sum {got.ravel()[0]} is not {want.ravel()[0]}")


def rank_generate(comm, model: str, prompt: list[int] | None, n_tokens: int, chunk: int, max_len: int = 512,
                  stop_after: int | None = None, plan: bool = False, exact_twins: bool = True,
                  prompts: list[list[int]] | None = None, slots: int | None = None, eos: tuple[int, ...] = ()) -> dict:
    """Rank `comm.rank`'s greedy run of checkpoint `model`: its step graphs (front/parallel.build_rank_step) run by
    the reference interpreter — or, with `plan`, planned for the cuda lane and run by the numpy backend in their
    arena (the exact twins, or the fast ones), each collective launch through the runner env's `comm`. Returns its
    tokens, its logits' parts (the rank's vocabulary part of each step's last row) and where they start.
    `prompts` (in place of `prompt`): a batch in `slots` slots (lane/run/batch.generate_batch over the rank's config:
    each slot's caches its KV heads', each prompt prefilled alone into its slot, then the batch's decode steps over
    every rank); `batch` then holds each prompt's tokens and logits' parts, in order. A sequence ends at a token of
    `eos` (every rank's arg-max is the same token, so every rank ends it at the same step).
    `stop_after`: this rank ends (a test's dying rank) after that many steps."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.parallel import build_rank_step, check_ranks, rank_config, rank_weights
    from lanefuse.lane.run.batch import generate_batch
    from lanefuse.lane.run.generate import generate

    cfg, weights = load_model(model, max_len=max_len)
    check_ranks(cfg, comm.ranks)
    rc = rank_config(cfg, comm.rank, comm.ranks)
    w = rank_weights(weights, cfg, comm.rank, comm.ranks)
    graphs: dict[tuple[int, int], object] = {}  # by (rows, batch): a 3-row chunk and a batch of 3 are two steps
    runners: dict[tuple[int, int], object] = {}
    steps = [0]
    table: list = [None]

    def step(g, env):
        batch = int(g.meta.get("batch", 1))
        key = (int(g.meta["rows"]) // batch, batch)
        if key not in graphs:
            graphs[key] = build_rank_step(cfg, comm.rank, comm.ranks, *key)
        if stop_after is not None and steps[0] >= stop_after:
            os._exit(3)  # the rank dies as a killed one would: no message, no goodbye to the others
        steps[0] += 1
        if not plan:
            return evaluate(graphs[key], w, env, comm=comm)
        if key not in runners:
            from lanefuse.engine.rules import load_table
            from lanefuse.lane.lower.plan import plan as make_plan
            from lanefuse.lane.run.numpy_runner import NumpyRunner

            if not runners:
                table[0] = load_table()  # the rule table read once a run (each plan() would read its YAML anew)
            runners[key] = NumpyRunner(make_plan(graphs[key], table=table[0]), w, exact=exact_twins)
            runners[key].env.comm = comm  # the collective launches meet the other ranks through it
        return runners[key].step(env)

    out = {}
    if prompts is not None:
        res = generate_batch(rc, w, prompts, n_tokens, slots, step_fn=step, chunk=chunk, eos=eos)
        out["batch"] = [{"tokens": r.generated_ids, "logits": [np.asarray(l, np.float32) for l in r.logits]}
                        for r in res]
        out["tokens"] = res[0].generated_ids
        out["prompt_s"], out["decode_s"] = sum(r.prompt_s for r in res), sum(r.decode_s for r in res)
    else:
        res = generate(rc, w, prompt, n_tokens, step_fn=step, chunk=chunk, eos=eos)
        out.update(tokens=res.generated_ids, logits=[np.asarray(l, np.float32) for l in res.logits],
                   prompt_s=res.prompt_s, decode_s=res.decode_s)
    out.update(vocab_from=graphs[min(graphs)].meta.get("vocab_from", 0), calls=getattr(comm, "calls", 0),
               bytes=getattr(comm, "bytes", 0))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a rank puts on the queue in place of a job's index when it ends early: its own refusal (a UserError: a model or
# rank count it does not serve), or a failure that may follow from another rank's death (a collective that lost a peer)
OWN, FAILED = -1, -2


def _worker(rank: int, ranks: int, port: int, jobs: list[dict], out, backend: str, timeout: float) -> None:
    """One rank's process: the process group (gloo over TCP on this machine), then each job's run, each result put
    on `out` as (rank, job index, result) — or (rank, -1, the error's one line)."""
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=timeout))
        for i, job in enumerate(jobs):
            exact = job.get("exact", True)
            comm = NcclComm(rank, ranks, exact) if backend == "nccl" else GlooComm(rank, ranks, exact)
            args = {k: v for k, v in job.items() if k not in ("exact", "die_rank")}
            if job.get("die_rank") == rank:
                args["stop_after"] = args.get("stop_after", 1)
            else:
                args.pop("stop_after", None)
            out.put((rank, i, rank_generate(comm, **args)))
        dist.destroy_process_group()
    except UserError as e:  # the rank's own refusal (every rank refuses alike): no other rank to blame
        out.put((rank, OWN, str(e)))
    except Exception as e:  # noqa: BLE001 - a rank's failure is said in one line by the launcher
        last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = f" ({os.path.basename(last.filename)}:{last.lineno})" if last else ""
        out.put((rank, FAILED, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"))


def _dead(procs, but: int, wait: float = 2.0) -> int | None:
    """A rank other than `but` that ended with a failing exit code, waiting up to `wait` seconds for one."""
    end = time.monotonic() + wait
    while True:
        for r, p in enumerate(procs):
            if r != but and p.exitcode not in (None, 0):
                return r
        if time.monotonic() > end:
            return None
        time.sleep(0.05)


def _context(mp):
    """The processes' start method: a fork server that imported torch and lanefuse once (each rank a fork of it: no
    second import of torch a rank, the most of a rank's start-up), else spawn (where fork is not offered)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # not egglog (lanefuse.engine.egraph, 0.5 s an import): a rank forked from a server that imported it hung in its
    # first plan (test_gloo_ranks_give_one_ranks_tokens[2] past 400 s; 54 s without it)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lanefuse.lane.run.ranks", "lanefuse.lane.lower.plan",
                                "lanefuse.engine.front.load"])
    return ctx


def launch(ranks: int, jobs: list[dict], backend: str = "gloo", timeout: float = TIMEOUT_S) -> list[list[dict]]:
    """Run `jobs` (rank_generate's keyword arguments, and `exact`) over `ranks` processes of this machine, each in
    turn; returns each job's results by rank. A rank that fails or dies ends the run with a UserError naming it (the
    others end at their next collective, after at most `timeout` seconds)."""
    import multiprocessing as mp

    why = gloo_missing()
    if why:
        raise UserError(f"--ranks {ranks}: {why}")
    if backend not in ("gloo", "nccl"):
        raise UserError(f"unknown rank backend `{backend}` (gloo on the CPU, nccl on GPUs)")
    ctx = _context(mp)
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, jobs, out, backend, timeout), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    results: list[list] = [[None] * ranks for _ in jobs]
    left = ranks * len(jobs)
    failed: str | None = None
    budget = timeout * (2 + len(jobs)) + 120  # start-up (imports) + each job
    deadline = time.monotonic() + budget
    try:
        while left and failed is None:
            try:
                rank, i, res = out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    r = dead[0]
                    try:  # a message it left before it ended says more than its exit code
                        rank, i, res = out.get(timeout=2.0)
                    except queue_mod.Empty:
                        failed = f"rank {r} of {ranks} died (exit code {procs[r].exitcode}); every rank stopped"
                        break
                elif time.monotonic() > deadline:
                    failed = f"the {ranks} ranks did not finish in {budget:.0f} s; every rank stopped"
                    break
                else:
                    continue
            if i < 0:
                failed = f"rank {rank} of {ranks}: {res}"
                dead = _dead(procs, rank) if i == FAILED else None
                if dead is not None:  # the others' errors follow from a rank that died: name it first
                    failed = (f"rank {dead} of {ranks} died (exit code {procs[dead].exitcode}); every rank stopped "
                              f"(rank {rank}: {clip(res, 100)})")
                break
            results[i][rank] = res
            left -= 1
    finally:
        for p in procs:
            if failed is not None and p.is_alive():
                p.terminate()
            p.join(timeout=timeout)
    if failed is not None:
        raise UserError(failed)
    return results


def joined_logits(by_rank: list[dict]) -> list[np.ndarray]:
    """Each step's whole logits row from the ranks' parts (for a test or a report: a run never gathers them)."""
    return [np.concatenate([r["logits"][s] for r in by_rank]) for s in range(len(by_rank[0]["logits"]))]
