"""The CuPy backend: the same Plan as the numpy backend, on the device — one device allocation for the arena: the
caches and carried states placed first (shared by a model's decode and prefill plans), then every step-local array a
view at its placed offset. The weights stay apart, uploaded once, each in an allocation of its own: seed 003's arena
is a step's memory (what a step computes and reads within it, placed by its lifetime) and the caches share its
allocation as the tables every form reads at the same offsets; a weight has no lifetime to overlay (seed 000's `Fill`:
filled before the first step, read by every step of every form), so one allocation for them would save no byte, and a
model's forms upload the constants each one needs as they are made (a later form may read one no form before read).
A decode step is captured once as a CUDA graph and replayed each token; the arg-max's advance writes the next token
and position on the device, so the host reads only the generated tokens (and the logits where asked). `decode_run` replays N steps back to back without
waiting on the host: each step's token (and logits) is copied on the device into a run of DECODE_CHUNK steps, which the
host reads once a chunk (an end-of-sequence id can stop it there), so N tokens cost ceil(N / DECODE_CHUNK) reads."""

from __future__ import annotations

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.kernels.cupy_env import DeviceEnv
from lanefuse.lane.lower.buffers import WORDS, array_bytes
from lanefuse.lane.lower.plan import Plan
from lanefuse.lane.run.constants import host_constant

DECODE_CHUNK = 16  # decode steps replayed between two host reads of the generated tokens (and their logits)


class DeviceArena:
    """The device allocation a model's forms share, one form running at a time (seed 003): from offset 0 the model's
    persistent tables — its KV caches and carried states, and a batch's (a slot a sequence) — each at the offset
    `place_tables` gives it, then from `base` the step-local arrays of whichever form runs. A runner keeps the
    allocation it was made with (its captured graph holds pointers into it, and into the tables), so an allocation is
    made anew only for tables not yet placed or a form larger than its step-local room, holding the new tables and room
    for the largest form so far; the tables of one no runner has used yet move into the new one (device to device),
    while a used one's stay where the runners made on it read them. A run places its tables (a batch's slots' with the
    one sequence's: `hold`) and reserves the room of the largest form it will take (lane/run/step.py `reserve`: a
    chained decode step can need more than the widest chunk) before any runner is made, so every form of a run shares
    the first allocation."""

    def __init__(self):
        self.buf = None
        self.base = 0  # the step-local arrays' first byte in `buf`
        self.room = 0  # the step-local bytes `buf` holds past `base`
        self.largest = 0  # the step-local bytes of the largest form made so far
        self.used = False  # a runner has taken views into `buf`
        self.held: dict[str, tuple[dict, str, int, int]] = {}  # key -> (its state's tables, name, offset, bytes)

    def fit(self, nbytes: int, tables: dict[str, tuple[dict, str, int]] | None = None, runner: bool = True):
        """Room for a form of `nbytes` step-local bytes and the tables `tables` {key: (the state's tables dict, name,
        bytes)} (each placed as an f32 view into the allocation, set in its state's dict); the step-local part (a
        byte view from `base`). `runner`: a runner takes views into it (it stays where it is from now on)."""
        import cupy

        from lanefuse.lane.lower.arena import place_tables

        tables = {k: t for k, t in (tables or {}).items() if k not in self.held}
        self.largest = max(self.largest, int(nbytes))
        if self.buf is None or tables or nbytes > self.room:
            keep = {} if self.used else {k: (d, n, b) for k, (d, n, _, b) in self.held.items()}
            every = {**keep, **tables}
            at, base = place_tables({k: b for k, (_, _, b) in every.items()})
            buf = cupy.zeros(max(base + self.largest, 1), dtype=cupy.uint8)
            held = {}
            for k, (d, n, b) in every.items():
                off = at[k][0]
                view = buf[off:off + b].view(cupy.float32)
                if k in keep:  # an unused allocation's table: its bytes carried over
                    view[...] = d[n]
                d[n] = view
                held[k] = (d, n, off, b)
            self.buf, self.base, self.room, self.held, self.used = buf, base, self.largest, held, False
        self.used = self.used or runner
        return self.buf[self.base:self.base + self.room]


class DeviceState:
    """What a model's plans share on the device: the KV-cache tables and the weights, by name, and the arena (which
    holds the tables). `label` keys this state's tables apart from another state's sharing the arena (a batch's
    slots beside one sequence's, under the same names)."""

    def __init__(self, label: str = ""):
        self.tables: dict[str, object] = {}
        self.weights: dict[str, tuple[object, str]] = {}
        self.loaded = False  # the caches were uploaded from the host once
        self.arena = DeviceArena()
        self.label = label

    def place(self, sizes: dict[str, int]) -> None:
        """Tables `sizes` {name: f32 values} this state does not hold yet, placed (zeroed) in the arena."""
        new = {self.label + n: (self.tables, n, 4 * int(v)) for n, v in sizes.items() if n not in self.tables}
        if new:
            self.arena.fit(0, new, runner=False)


def slot_copier(state: DeviceState, batch_state: DeviceState):
    """`to_slot(slot, slots)` for a batch: a prompt prefilled on the device (into `state`'s one-sequence caches), its
    caches copied into `slot`'s rows of the batch step's (`slots` slots, placed in the arena on the first copy),
    device to device. `to_slot.fresh()`: the one-sequence tables zeroed before a prompt's prefill (the host's zeroed
    copies are uploaded once only): a carried state (a convolution ring, a delta-rule state) is read from its start,
    so a prompt must not start from the last one's, as batch.py's prefill zeroes a slot's rows on the host."""
    def to_slot(slot: int, slots: int) -> None:
        batch_state.place({n: slots * t.size for n, t in state.tables.items()})
        batch_state.loaded = True  # the host's caches are never uploaded over the slots
        for n, t in state.tables.items():
            b = batch_state.tables[n]
            b[slot * t.size: (slot + 1) * t.size] = t

    def fresh() -> None:
        for t in state.tables.values():
            t.fill(0)

    to_slot.fresh = fresh

    return to_slot


def holder(state: DeviceState, batch_state: DeviceState):
    """`hold(shapes, slots=1)` for generate / generate_batch on the device: the carried tables `shapes` placed in the
    arena before any form is made — a batch's `slots` slots' tables with one sequence's beside them (its prefill's) —
    so the run's forms share one allocation; the host's zeroed copies returned (uploaded once, over zeros)."""
    def hold(shapes: dict, slots: int = 1) -> dict[str, np.ndarray]:
        one = {n: int(np.prod(sh)) // slots for n, sh in shapes.items()}
        new = {state.label + n: (state.tables, n, 4 * v) for n, v in one.items() if n not in state.tables}
        if slots > 1:
            new.update({batch_state.label + n: (batch_state.tables, n, 4 * v * slots) for n, v in one.items()
                        if n not in batch_state.tables})
            batch_state.loaded = True
        if new:
            state.arena.fit(0, new, runner=False)
        return {n: np.zeros(sh, dtype=np.float32) for n, sh in shapes.items()}

    return hold


def _weights_of(s: Plan, weights, have) -> dict[str, tuple[np.ndarray, str]]:
    """The host copies of the constants the device does not hold yet."""
    return {name: host_constant(c, weights) for name, c in s.constants.items() if name not in have}


def carried(s: Plan) -> tuple[str, ...]:
    """The arrays plan `s`'s step reads as its inputs and updates in place, by home: the token and position (the
    arg-max's advance), the carried states (convolution rings, delta-rule states) and any other table a launch
    writes — all but the KV caches, which a step writes only at its own rows, each row from what the step reads
    before it (the token, the position, the states, the rows before): a step run twice from the same inputs writes
    the same rows. A step run twice from one copy of these reads a second step's inputs the second time."""
    kv = {n for pair in s.io.caches for n in pair}
    inputs = set(s.io.inputs)
    homes = (s.buffers[n].home for x in s.launches for n in x.launch.writes() if n in s.buffers)
    return tuple(dict.fromkeys(h for h in homes if h in inputs and h not in kv))


class CupyRunner:
    """Runs one Plan on the device; `step` has the numpy backend's interface."""

    def __init__(self, s: Plan, weights, state: DeviceState | None = None, graph: bool = True):
        import cupy

        self.cp = cupy
        self.s = s
        self.state = state or DeviceState()
        placed = s.arena.by_name()
        arena_views, quantized = {}, {}
        for name, b in s.buffers.items():
            if b.where == "arena" and b.home in placed and b.dtype in WORDS:  # a quantized form: its bytes
                home = s.buffers[b.home]  # a row read quantized: a view into its tensor's form (its home's bytes)
                arena_views[name] = (placed[b.home].offset, array_bytes(home.size, b.dtype), "u8")
                quantized[name] = ((b.size, WORDS[b.dtype]) if b.home == name else
                                   (b.size, WORDS[b.dtype], home.size, b.offset))
            elif b.where == "arena" and b.home in placed:
                arena_views[name] = (placed[b.home].offset + 4 * b.offset, 4 * b.size, b.dtype)
        scratch = {}
        for i, x in enumerate(s.launches):
            for sc in x.launch.scratch():
                p = placed.get(f"#{i}.{sc.tag}")
                if p is not None:
                    scratch[(x.launch.key(), sc.tag)] = p.offset
        missing = _weights_of(s, weights, self.state.weights)
        st = self.state
        tables = {st.label + b.home: (st.tables, b.home, 4 * s.tensors[b.home].size) for b in s.buffers.values()
                  if b.where == "table" and b.home not in st.tables}  # the caches, placed in the arena
        self.env = DeviceEnv(s.arena.bytes, arena_views, {}, missing, scratch, quantized,
                             arena=st.arena.fit(s.arena.bytes, tables))
        self.state.weights.update(self.env.weights)
        self.env.weights = self.state.weights
        # what a launch's numpy twin run on this env reads of the plan, as on an ArenaEnv (its Quant launches: the
        # q8 numerics' norms and attention; llama.cpp's rope of the model: engine/formats/ggml.plan_rope)
        self.env.s = s
        self.env.llama_rope = ggml.llama_rope(getattr(weights, "cfg", None)) if s.numerics == "q8" else None
        for name, b in s.buffers.items():  # the caches (shared), the step's inputs and outputs
            if b.where == "table":
                t = st.tables[b.home]
                if t.size != s.tensors[b.home].size:
                    raise ValueError(f"table `{b.home}` of {s.tensors[b.home].size} values; the model's state holds "
                                     f"{t.size}")
                self.env.views[name] = t[b.offset: b.offset + b.size]
        for name, b in s.buffers.items():
            if b.where == "io":
                if b.home not in self.env.views:
                    dt = cupy.int32 if s.tensors[b.home].dtype == "i32" else cupy.float32
                    self.env.views[b.home] = cupy.zeros(s.tensors[b.home].size, dtype=dt)
                self.env.views[name] = self.env.views[b.home][b.offset: b.offset + b.size]
        self.use_graph = graph
        self._graph = None
        self._carried = carried(s)
        # every upload, launch and read of this runner goes through one stream, in order
        self._stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.Device().synchronize()  # the weights and tables uploaded above are in place

    def run_launches(self) -> None:
        with self._stream:
            for x in self.s.launches:
                if x.launch.kernels():  # a view runs nothing
                    x.launch.cuda(self.env)

    def _launch(self) -> None:
        """One step enqueued on the runner's stream (a graph replay, or the launches one by one); nothing waits."""
        if not self.use_graph:
            self.run_launches()
            return
        if self._graph is None:
            # compile every kernel, upload every descriptor table and allocate every scratch before capture: nothing
            # may allocate, copy from the host or synchronize while the stream is captured. The warm-up runs the
            # step for real, so what it updates in place is kept first and put back after it: the first replay is
            # then this step, run once
            kept = self.keep_carried()
            self.run_launches()
            self._stream.synchronize()
            self.put_back(kept)
            with self._stream:
                self._stream.begin_capture()
                self.run_launches()
                self._graph = self._stream.end_capture()
        self._graph.launch(stream=self._stream)

    def _replay(self) -> None:
        self._launch()
        self._stream.synchronize()

    def keep_carried(self) -> dict[str, object]:
        """A device copy of each array the step reads and then updates in place (`carried`): the token and the
        position the arg-max advances, a gated delta net's convolution rings and recurrent states."""
        with self._stream:
            kept = {n: self.env.views[n].copy() for n in self._carried}
        self._stream.synchronize()
        return kept

    def put_back(self, kept: dict[str, object]) -> None:
        """The arrays `keep_carried` kept, as they were before the warm-up run (device to device)."""
        with self._stream:
            for n, v in kept.items():
                self.env.views[n][...] = v
        self._stream.synchronize()

    def load_inputs(self, inputs: dict) -> None:
        io = self.s.io
        cp = self.cp
        with self._stream:
            self.env.views[io.token][:] = cp.asarray(np.asarray(inputs[io.token], dtype=np.int32).reshape(-1))
            self.env.views[io.position][:] = cp.asarray(np.asarray(inputs[io.position], dtype=np.int32).reshape(-1))
            for n in getattr(io, "params", ()):  # a sampled step's parameter words (lane/run/sampling.py)
                if n in inputs:
                    self.env.views[n][:] = cp.asarray(np.asarray(inputs[n], dtype=np.int32).reshape(-1))
        self._stream.synchronize()

    def step(self, inputs: dict, lifted=None) -> dict:
        """One step: upload the token and position, replay, read the logits and the next token. The caches stay on
        the device (the host's copies in `inputs` are not read after the first step of a model)."""
        io = self.s.io
        self.load_step_inputs(inputs)
        self._replay()
        logits = self.cp.asnumpy(self.env.views[io.logits], stream=self._stream)
        nxt = self.cp.asnumpy(self.env.views[io.next], stream=self._stream)
        self._stream.synchronize()
        return {io.logits: logits.reshape(self.s.tensors[io.logits].shape), io.next: nxt}

    def load_step_inputs(self, inputs: dict) -> None:
        """A step's inputs from the host: the caches on the model's first step (the host's copies are not read
        after it), the token and the position."""
        io = self.s.io
        self.s.check_position(inputs[io.position])
        if not self.state.loaded:
            with self._stream:
                for n in io.tables:
                    if n in inputs:
                        self.state.tables[n][:] = self.cp.asarray(np.asarray(inputs[n], dtype=np.float32).reshape(-1))
            self._stream.synchronize()
            self.state.loaded = True
        self.load_inputs(inputs)

    def decode(self, n: int) -> list[int]:
        """`n` decode steps replayed back to back from the device's own token and position (the arg-max advances
        them); the host reads the position once and the generated tokens once a chunk (`decode_run`)."""
        return [int(t[0]) for t in self.decode_run(n, logits=False)[0]]

    def decode_run(self, n: int, inputs: dict | None = None, logits: bool = True, eos=(), chunk: int = DECODE_CHUNK,
                   on_chunk=None) -> tuple[np.ndarray, np.ndarray | None]:
        """`n` decode steps of this decode plan, each from the token and position the step before advanced on the
        device (the first from `inputs`' token and position, uploaded, or else the device's own), replayed back to
        back: nothing reads the device between two steps. After each step its `next` (a row a sequence of a batch)
        and, with `logits`, its logits' bits are copied on the device into the chunk's run; the host reads the run
        once a chunk of `chunk` steps, tokens and logits in one read. Where a token (of a one-sequence plan) is an id of
        `eos`, the run stops there: the tokens after it are dropped, and the step's carried inputs (`carried`) are
        left as the steps up to it left them (the token and position put back, or the chunk's carried state put back
        and the steps up to the end replayed), so a step after it runs as after the step-by-step loop; the KV rows
        past it are rewritten by the step that reaches them before anything reads them. Returns the tokens
        (steps, next's size) and the logits (steps, logits' size) or None. `on_chunk(k)` after each chunk's k steps."""
        io, cp = self.s.io, self.cp
        if inputs is not None:
            self.load_step_inputs(inputs)
            pos = int(np.asarray(inputs[io.position]).reshape(-1)[0])
        else:
            pos = int(cp.asnumpy(self.env.views[io.position][:1], stream=self._stream)[0])
        length = self.s.tensors[self.s.io.caches[0][0]].shape[0] if self.s.io.caches else None
        if length is not None and self.s.batch == 1 and pos + n > length:
            from lanefuse.engine.errors import UserError

            raise UserError(f"{n} decode steps from position {pos} run past the KV cache of {length} rows")
        if chunk < 1:
            raise ValueError(f"a decode chunk of {chunk} steps")
        nxt, lg = self.env.views[io.next], self.env.views[io.logits]
        ns, nl = nxt.size, (lg.size if logits else 0)
        if n <= 0:
            return np.zeros((0, ns), np.int32), (np.zeros((0, nl), np.float32) if logits else None)
        chunk = max(1, min(chunk, n))
        with self._stream:  # a chunk's steps a row each: the tokens, then the logits' bits (one read takes both)
            run = cp.zeros((chunk, ns + nl), dtype=cp.int32)
            bits = lg.view(cp.int32) if logits else None
        ends = frozenset(int(e) for e in eos) if self.s.batch == 1 else frozenset()
        light = set(self._carried) <= {io.token, io.position}  # no carried state besides the advanced ones
        toks, outs, done = [], [], 0
        while done < n:
            k = min(chunk, n - done)
            kept = self.keep_carried() if ends and not light else None  # device to device: no read
            with self._stream:
                for i in range(k):
                    self._launch()
                    run[i, :ns] = nxt
                    if bits is not None:
                        run[i, ns:] = bits
            got = cp.asnumpy(run[:k], stream=self._stream)  # the one read of the chunk: waits for its steps
            self._stream.synchronize()
            stop = next((i for i in range(k) if int(got[i, ns - 1]) in ends), None)
            if stop is not None:
                got = got[: stop + 1]
                self._rewind(pos + done + stop + 1, int(got[stop, ns - 1]), kept, stop + 1, k)
            toks.append(got[:, :ns])
            if logits:
                outs.append(got[:, ns:].view(np.float32))
            done += len(got)
            if on_chunk is not None:
                on_chunk(len(got))
            if stop is not None:
                break
        tokens = np.concatenate(toks)
        return tokens, (np.concatenate(outs) if logits else None)

    def _rewind(self, pos: int, token: int, kept, steps: int, ran: int) -> None:
        """After a chunk of `ran` steps of which the first `steps` are kept: the step's carried inputs as those
        `steps` left them. With no carried state but the token and position, the two are set (an upload); else the
        chunk's carried inputs (`kept`) are put back and its first `steps` steps replayed."""
        if steps == ran:
            return
        if kept is None:
            self.load_inputs({self.s.io.token: [token], self.s.io.position: [pos]})
            return
        self.put_back(kept)
        with self._stream:
            for _ in range(steps):
                self._launch()
        self._stream.synchronize()
