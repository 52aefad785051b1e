"""The numpy backend: a Plan run launch by launch with each kind's numpy twin, every step-local array a view
into ONE arena byte buffer at its placed offset (a placement bug shows as a wrong number), the caches and carried
states in that buffer too where the caller holds them there (SharedArena.hold: generate and generate_batch through
lane/run/step.py), before the step-local arrays; the step's token, position and outputs in buffers of their own. Two sets of twins: the exact ones (the kernels' sums imitated in f64, what
the GPU is compared against) and the fast ones `lanefuse run` takes on the CPU (f32 BLAS on weights decoded once,
results written into the arena views, temporaries in a tail of the arena, each launch bound to its views once; equal
to the exact ones within f32 rounding). `LANEFUSE_CHECK=2` runs the reference interpreter beside the exact twins and
names the first launch that diverges."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.kernels.common import Q8K, QSUM, qblock, quant_parts_at
from lanefuse.lane.lower.buffers import WORDS
from lanefuse.lane.lower.plan import Plan
from lanefuse.lane.run.constants import (IN_PLACE, decode_once, host_constant, host_matrix, host_stacked,
                                         streamed_bytes, streamed_stacked)

DT = {"f32": np.float32, "i32": np.int32}


class SharedArena:
    """The one byte buffer a model's forms (its decode step, each prefill chunk width, a batch's step) share, one form
    running at a time (seed 003): from offset 0 the model's persistent tables — its KV caches and carried states, or a
    batch's (a slot a sequence) — each at the offset `place_tables` gives it (`hold`), then from `base` the step-local
    arrays of whichever form runs, sized for the largest form made so far. A larger form grows it (`fit`): the tables'
    bytes are copied into the new buffer and the runners made before take views into it at their next step
    (`version`). Nothing a step reads of the step-local part is left from another step or form: every array there is
    written whole before it is read (lane/lower/buffers.py `walk`)."""

    def __init__(self):
        self.buf = np.zeros(0, dtype=np.uint8)
        self.version = 0
        self.placed: dict[str, tuple[int, int]] = {}  # table -> (offset, bytes) in `buf`
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.base = 0  # the step-local arrays' first byte
        self.room = 0  # the step-local bytes of the largest form made so far
        # the buffer the last growth replaced, until the next step: the views its caller took before the growth (the
        # step whose form grew it) are read in the new buffer; kept no longer, so the tables are not held twice
        self.moved: np.ndarray | None = None

    def fit(self, nbytes: int) -> None:
        """Room for a form of `nbytes` step-local bytes."""
        if nbytes > self.room:
            self._grow(self.base, nbytes)

    def _grow(self, base: int, room: int) -> None:
        new = np.zeros(base + room, dtype=np.uint8)
        keep = min(self.base, base)
        new[:keep] = self.buf[:keep]  # the tables, where they stay
        self.moved, self.buf, self.base, self.room = self.buf, new, base, room
        self.version += 1

    def hold(self, shapes: dict[str, tuple[int, ...]], slots: int = 1) -> "HeldTables":
        """The persistent tables `shapes` {name: shape} (f32, zeroed) placed in the buffer from offset 0, the step-local
        part moved past them; the tables as a mapping of f32 views into the current buffer (taken anew after a growth).
        Holding another set of tables (a batch's slots where one sequence's were) places that set instead. `slots`: a
        batch's (its one-sequence prefills take a slot's rows of these tables, inside the buffer too)."""
        from lanefuse.lane.lower.arena import place_tables

        shapes = {n: tuple(int(d) for d in sh) for n, sh in shapes.items()}
        if shapes != self.shapes:
            placed, base = place_tables({n: 4 * int(np.prod(sh)) for n, sh in shapes.items()})
            self.base = 0  # nothing of the old tables is kept
            self._grow(base, self.room)
            self.placed, self.shapes = placed, shapes
            self.moved = None  # the old tables' views are no views of these
        return HeldTables(self)

    def table(self, name: str) -> np.ndarray:
        off, nbytes = self.placed[name]
        return np.frombuffer(self.buf, dtype=np.float32, count=nbytes // 4, offset=off).reshape(self.shapes[name])

    def inside(self, t: np.ndarray) -> np.ndarray:
        """Table array `t` as the step takes it: a view into the buffer where `t` is one (a held table, a slot's rows
        of one) or was one before the last growth (the same bytes in the new buffer); any other array as given."""
        if self.moved is not None and self.moved.size and _within(t, self.moved):
            at = t.__array_interface__["data"][0] - self.moved.__array_interface__["data"][0]
            if at + t.nbytes <= self.base and t.flags.c_contiguous:
                return np.frombuffer(self.buf, dtype=t.dtype, count=t.size, offset=at).reshape(t.shape)
        return t


def _within(t: np.ndarray, buf: np.ndarray) -> bool:
    lo, n = buf.__array_interface__["data"][0], buf.nbytes
    at = t.__array_interface__["data"][0]
    return lo <= at and at + t.nbytes <= lo + n


class HeldTables(Mapping):
    """A SharedArena's tables by name, each a view into its buffer as it is now."""

    def __init__(self, shared: SharedArena):
        self.shared = shared

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shared.placed:
            raise KeyError(name)
        return self.shared.table(name)

    def __iter__(self):
        return iter(self.shared.shapes)

    def __len__(self) -> int:
        return len(self.shared.shapes)


class ArenaEnv:
    """The Env the numpy twins read and write through: arena views, cache tables, step I/O, weights."""

    def __init__(self, s: Plan, weights, tables: dict[str, np.ndarray], exact: bool = True, temp: int = 0,
                 stream: bool = False, shared: SharedArena | None = None):
        self.s = s
        self.weights = weights
        self.exact = exact
        self.stream = stream  # fast twins: decode each launch's rows as it runs instead of once (memory-bound)
        # streamed: one buffer the launch's IN_PLACE rows are decoded into, each constant its own part, launch after
        # launch (`stream_at`: the next part's first value, set back to 0 before each launch); made at first use
        self._stream: np.ndarray | None = None
        self.stream_at = 0
        # the plan's arena, then (fast twins) a tail of `temp` f32 values every launch's temporaries share in turn,
        # the first bytes of the buffer the model's forms share (`shared`), or of one of its own
        self.need = s.arena.bytes + (-s.arena.bytes % 64) + 4 * temp
        self.temp_count = temp
        self.shared = shared if shared is not None else SharedArena()
        self.shared.fit(self.need)
        self.placed = s.arena.by_name()
        self.tables = tables
        self.io: dict[str, np.ndarray] = {}
        self._views: dict[str, np.ndarray] = {}
        self.bind_arena()
        self._weights: dict[str, tuple[np.ndarray, str]] = {}

    def bind_arena(self) -> None:
        """Take this plan's part of the shared buffer as it is now (made anew when a larger form grew it or tables
        were placed before its step-local part): `need` bytes from the buffer's `base`."""
        self.arena = self.shared.buf[self.shared.base:self.shared.base + self.need]
        self.version = self.shared.version
        self._temp = np.frombuffer(self.arena, dtype=np.float32, count=self.temp_count,
                                   offset=self.need - 4 * self.temp_count)
        self._views.clear()

    def _home(self, home: str) -> np.ndarray:
        b = self.s.buffers[home]
        if b.where == "arena":
            p = self.placed[home]
            return np.frombuffer(self.arena, dtype=DT[b.dtype], count=b.size, offset=p.offset)
        if b.where == "table":
            t = self.tables[home]
            return t.reshape(-1)
        if home not in self.io:
            self.io[home] = np.zeros(b.size, dtype=DT[b.dtype])
        return self.io[home]

    def quant(self, name: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Tensor `name`'s quantized form in the arena: its int8 words, its low words (None under one word), its
        scales (kernels/quant.py's layout)."""
        b = self.s.buffers[name]
        if b.where != "arena" or b.dtype not in WORDS:
            raise KeyError(f"`{name}` has no quantized form in the plan")
        words = WORDS[b.dtype]
        off = self.placed[b.home].offset
        at, lo, sc = quant_parts_at(b.size, words, self.s.buffers[b.home].size, b.offset)  # a row: a view into it
        w = np.frombuffer(self.arena, dtype=np.int8, count=b.size, offset=off + at)
        low = (np.frombuffer(self.arena, dtype=np.int8, count=b.size, offset=off + lo) if words == 2 else
               np.frombuffer(self.arena, dtype=np.int16, count=b.size // QSUM, offset=off + lo) if words == Q8K
               else None)  # the q8k form's sums of 16 words (int16) stand where q8x2's low words do
        return w, low, np.frombuffer(self.arena, dtype=np.float32, count=b.size // qblock(words), offset=off + sc)

    def array(self, name: str) -> np.ndarray:
        v = self._views.get(name)
        if v is not None:
            return v
        b = self.s.buffers.get(name)
        if b is None:
            raise KeyError(f"no buffer for `{name}` in the plan")
        base = self._home(b.home)
        v = base[b.offset: b.offset + b.size] if name != b.home else base
        self._views[name] = v
        return v

    def weight(self, name: str) -> tuple[np.ndarray, str]:
        w = self._weights.get(name)
        if w is None:
            c = self.s.constants[name]
            if not self.exact and (c.kind == "values" or c.format == "f32"):
                w = (host_matrix(c, self.weights), "f32")  # the same values, one copy with the fast twins' matrices
            else:
                w = host_constant(c, self.weights)
            self._weights[name] = w
        return w

    def matrix(self, name: str) -> np.ndarray:
        """Constant `name` as flat f32 values, decoded once (the fast twins' weights; streamed: for this launch)."""
        c = self.s.constants[name]
        if self.stream and c.kind == "rows" and c.format != "f32":
            return self._streamed([c])
        return host_matrix(c, self.weights)

    def stacked(self, names: tuple[str, ...]) -> np.ndarray:
        """Constants `names` (rows of one width) as one flat f32 matrix, their rows in turn, decoded once
        (streamed: for this launch)."""
        cs = [self.s.constants[n] for n in names]
        if self.stream:
            return self._streamed(cs)
        return host_stacked(cs, self.weights)

    def _streamed(self, cs) -> np.ndarray:
        """Constants `cs` decoded for this launch: into the next part of the streaming buffer where it has room
        (a launch that asks for a constant twice gets arrays made for it past its plan's budget), else into arrays
        made for the launch."""
        if any(c.format not in IN_PLACE for c in cs):  # a block format: decoded into arrays of its own
            return streamed_stacked(cs, self.weights)
        if self._stream is None:
            self._stream = np.empty(streamed_bytes(self.s), dtype=np.float32)
        size = sum(c.size for c in cs)
        if self.stream_at + size > self._stream.size:
            return streamed_stacked(cs, self.weights)
        out = self._stream[self.stream_at: self.stream_at + size]
        self.stream_at += size
        return streamed_stacked(cs, self.weights, out)

    def columns(self, names: tuple[str, ...], k: int) -> np.ndarray:
        """That matrix stored transposed, (k, n) flat, decoded once."""
        return host_stacked([self.s.constants[n] for n in names], self.weights, columns=True)

    def temp(self, count: int) -> np.ndarray:
        """`count` f32 values of the arena's tail, a fast twin's temporary for the length of its launch. A launch
        that asks for more than its kind's `fast_temp` declared (the tail's size) is a bug in that kind: said here,
        not found later as an empty view."""
        if count > self._temp.size:
            raise RuntimeError(f"a fast twin asked for {count} temporary values; the runner's tail holds "
                               f"{self._temp.size} (the largest `fast_temp()` of the plan's launches)")
        return self._temp[:count]

    def param(self, name: str) -> int:
        return int(self.array(name)[0])


class NumpyRunner:
    """Runs one Plan step after step; the arena and weights are kept across steps."""

    def __init__(self, s: Plan, weights, check: bool = False, exact: bool = True, decode_budget: int | None = None,
                 shared: SharedArena | None = None):
        self.s = s
        self.check = check  # run the reference beside each step and compare launch by launch (LANEFUSE_CHECK=2)
        self.exact = exact or check  # the exact twins (the kernels' sums imitated in f64), else each kind's fast twin
        self.weights = weights
        temp = 0 if self.exact else max((x.launch.fast_temp() for x in s.launches), default=0)
        # the fast twins hold f16/bf16/block rows decoded to f32 where memory allows (`decode_budget` bytes, default
        # half the machine's), else decode each launch's rows as it runs
        self.streamed = not self.exact and not decode_once(s, decode_budget)
        self.env = ArenaEnv(s, weights, {}, exact=self.exact, temp=temp, stream=self.streamed, shared=shared)
        self._bound: list | None = None  # the fast twins bound to the env (Launch.bind_fast), made anew with the tables
        self.bind_s = 0.0  # seconds binding them (the first binding reads and stacks the weights: load, not a step)

    def step(self, inputs: dict[str, np.ndarray], lifted=None) -> dict[str, np.ndarray]:
        s, env = self.s, self.env
        s.check_position(inputs[s.io.position])
        if env.version != env.shared.version:  # another form grew the shared arena: this plan's views made anew
            env.bind_arena()
            self._bound = None
        tables = {n: env.shared.inside(inputs[n]) for n in s.io.tables}  # a held table's view into the buffer
        env.shared.moved = None  # the replaced buffer let go: a caller takes its tables anew each step (generate)
        if tables.keys() != env.tables.keys() or any(env.tables[n] is not t for n, t in tables.items()):
            env.tables = tables  # other cache arrays than the last step's: views into them are made anew
            env._views.clear()
            self._bound = None
        for n in (s.io.token, s.io.position):
            env.array(n)[:] = np.asarray(inputs[n], dtype=np.int32).reshape(-1)
        for n in getattr(s.io, "params", ()):  # a sampled step's parameter words (lane/run/sampling.py)
            if n in inputs:
                env.array(n)[:] = np.asarray(inputs[n], dtype=np.int32).reshape(-1)
        if not self.exact:
            if self._bound is None:
                t0 = time.perf_counter()
                self._bound = [x.launch.bind_fast(env) for x in s.launches]
                self.bind_s += time.perf_counter() - t0
            if self.streamed:
                for call in self._bound:
                    env.stream_at = 0  # each launch decodes its rows into the streaming buffer from its start
                    call()
            else:
                for call in self._bound:
                    call()
            return self._outputs()
        ref = self._reference(lifted, inputs) if self.check and lifted is not None else None
        if ref is None:
            for x in s.launches:
                x.launch.numpy(env)
            return self._outputs()
        last = {}  # each name a launch writes -> the last launch of the step writing it: where its values are final
        for i, x in enumerate(s.launches):
            for name in x.launch.writes():
                last[name] = i
        before = self._tables_before(last)  # each table the step writes, as it is before the step
        for i, x in enumerate(s.launches):
            x.launch.numpy(env)
            self._compare(i, x, ref, before, last)
        return self._outputs()

    def _outputs(self) -> dict[str, np.ndarray]:
        s, env = self.s, self.env
        return {s.io.logits: env.array(s.io.logits).reshape(s.tensors[s.io.logits].shape).copy(),
                s.io.next: env.array(s.io.next).copy()}

    def _reference(self, lifted, inputs):
        from lanefuse.engine.interp import evaluate

        from lanefuse.engine.formats.quantize import with_numerics

        env = {k: (np.array(v, copy=True) if k in self.s.io.tables else v) for k, v in inputs.items()}
        return evaluate(with_numerics(lifted, self.s.numerics), self.weights, env)

    def _tables_before(self, names) -> dict[str, np.ndarray]:
        """Each cache table or carried state among `names`, whole, as it is before the step runs (a batch writes
        each sequence's rows in its own slot; a state is rewritten whole)."""
        return {n: self.env.array(n).copy() for n in names
                if (b := self.s.buffers.get(n)) is not None and b.where == "table"}

    def _compare(self, i: int, x, ref, before: dict[str, np.ndarray], last: dict[str, int]) -> None:
        """What launch `i` wrote against the reference, each name at the launch that writes it last in the step
        (where its values are final: a table row written by two launches, an array rewritten): a computed array
        whole; of a cache table or state, the values the step changed. A launch's value in a buffer of
        another of its ops' names (a product's bias added in place: `o + bias` in `o`'s buffer) is that op's."""
        s, env = self.s, self.env
        for name in x.launch.writes():
            b = s.buffers.get(name)
            if b is None or name not in ref or name == s.io.token or name == s.io.position or last.get(name) != i:
                continue
            if name == s.io.next and getattr(s.io, "params", ()):  # sampled: a draw, not the reference's arg-max
                continue
            if b.dtype in WORDS:  # a quantized form: the values its words stand for, against the reference's
                from lanefuse.kernels.q8dot import dequantized

                got = dequantized(*env.quant(name), 1, b.size).reshape(-1)
                want = ref[name].values().reshape(-1)
            else:
                got = env.array(name)
                want = np.asarray(ref[name]).reshape(-1)
            if b.where == "table":  # the values the step changed, wherever they lie
                changed = got != before[name]
                got, want = got[changed], want[changed]
            elif got.shape == want.shape and not self._close(got, want):
                writes = x.launch.writes()
                for op in x.ops:  # the launch's ops it writes no buffer of: the one whose value it stored there
                    if op not in writes and op in ref and b.dtype not in WORDS:
                        other = np.asarray(ref[op]).reshape(-1)
                        if other.shape == got.shape and self._close(got, other):
                            want = other
                            break
            if got.shape != want.shape:
                continue
            what = f"launch {i} ({x.launch.census}, layer {x.layer}, computing {', '.join(x.ops) or '-'})"
            if got.size and not np.isfinite(got).all():  # NaN compares as no difference: said on its own
                also = ("; the reference's too: a weight or an input holds it" if not np.isfinite(want).all() else
                        "; the reference's are finite")
                raise UserError(f"LANEFUSE_CHECK=2: {what} writes non-finite values (NaN or inf) to `{name}`{also}")
            if not self._close(got, want):
                err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.size else 0.0
                scale = float(np.max(np.abs(want))) if want.size else 0.0
                raise UserError(f"LANEFUSE_CHECK=2: {what} diverges from the reference at `{name}`: max |diff| "
                                f"{err:.3g} (values up to {scale:.3g})")

    @staticmethod
    def _close(got: np.ndarray, want: np.ndarray) -> bool:
        """Within the check's tolerance: 1e-4 of the values' scale (at least 1); NaN is never close."""
        if not got.size:
            return True
        with np.errstate(invalid="ignore", over="ignore"):
            err = float(np.max(np.abs(got.astype(np.float64) - want)))
            scale = float(np.max(np.abs(want)))
        return err <= 1e-4 * max(scale, 1.0)
