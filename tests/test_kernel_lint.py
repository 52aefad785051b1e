"""The arrival-counter contract (seed 003, kernels/common.py's `Scratch`), checked on the CPU from both sides.

The .cu side, a lint over kernels/*.cu: every atomic a kernel runs is classified. An arrival counter (an atomicAdd /
atomicInc whose old value is compared, `last = atomicAdd(c, 1u) == blocks - 1`) must be reset to zero, in the same
function, by the block that saw itself last: after its gate (`if (!last) return;` / `continue;`, or inside
`if (last) {...}`), in the gate's own block, with no return, break or continue between the gate and the reset. A counter
is zero before the launch and left zero by it; under a CUDA graph every step after the first is a second launch, so a
counter left non-zero stalls every later step. A keyed reduction (an atomicMax / atomicMin into a scratch, fold.cu's
arg-max keys) is held to the same contract: the last block to arrive at the function's arrival counter sets it back to
zero. Any other atomic fails the lint until it is classified here (a reduction into an output needs its output zeroed
before each launch, which a graph replay does not do by itself).

The Python side: every kernel parameter that is a counter (`unsigned*`: the sources use that type for counters alone)
is passed a scratch its launch declares `counter=True`; a plan keeps counters out of the arena, and the device env
gives each its own zeroed buffer that no other array shares; and each launch's numpy twin, run twice in a row, writes
the same values (the graph-replay property the counters exist to keep), launches that advance their own state aside."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources

import numpy as np
import pytest

COUNTER_OPS = ("atomicAdd", "atomicInc")


# -- the .cu lint ---------------------------------------------------------------------------------------------------

def strip_comments(src: str) -> str:
    """The source without comments (each replaced by spaces, newlines kept) and with macro line continuations joined;
    string and character literals kept as they are."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return re.sub(r"\\\n", "  ", "".join(out))


def matching(text: str, i: int, open_: str = "(", close: str = ")") -> int:
    """The index of the bracket closing the one at `i`."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced {open_!r} at {i}")


@dataclass
class Function:
    name: str
    start: int  # the body's `{`
    end: int  # its `}`


def functions(text: str) -> list[Function]:
    """Each top-level brace block (a function, a macro defining one, a struct) with the name before its parameters."""
    out, i = [], 0
    last_end = 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        j = matching(text, i, "{", "}")
        head = text[last_end:i]
        m = re.search(r"(\w+)\s*(?:<[^<>]*>)?\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*(?:const\s*)?$", head)
        out.append(Function(m.group(1) if m else head.split()[-1] if head.split() else "?", i, j))
        last_end = i = j + 1


def enclosing_block(text: str, lo: int, at: int) -> tuple[int, int]:
    """(start, end) of the innermost brace block of text[lo:] holding position `at`."""
    depth, opens = 0, []
    for j in range(lo, at):
        if text[j] == "{":
            opens.append(j)
        elif text[j] == "}":
            opens.pop()
    start = opens[-1]
    return start, matching(text, start, "{", "}")


def args_of(text: str, open_paren: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose `(` is at `open_paren`."""
    close = matching(text, open_paren)
    out, depth, cur = [], 0, []
    for c in text[open_paren + 1:close]:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur).strip())
    return out


def reset_forms(ptr: str) -> list[str]:
    """The statements (spaces removed) that set the element `ptr` points at to zero: `*c = 0u`, `c[0] = 0`,
    `base[off] = 0u` for `base + off`, or an atomicExch of it with 0."""
    p = re.sub(r"\s+", "", ptr)
    if p.startswith("(") and p.endswith(")") and matching(p, 0) == len(p) - 1:
        p = p[1:-1]
    forms = []
    m = re.fullmatch(r"(\w+)\+(.+)", p)
    if m:
        forms.append(f"{m.group(1)}[{m.group(2)}]")
    if re.fullmatch(r"\w+", p):
        forms += [f"*{p}", f"{p}[0]"]
    forms.append(f"*({p})")
    zero = r"=\s*(?:\(unsigned\))?0(?:u|ull)?;"
    pats = [re.escape(f) + zero for f in forms]
    pats.append(r"atomicExch\(" + re.escape(p) + r",0u?\);")
    return pats


@dataclass
class Atomic:
    file: str
    function: str
    op: str
    ptr: str
    kind: str  # "counter", "reset" (atomicExch(c, 0)), "shared" (into a block's zeroed shared array), "keyed" (a max or
    # min into scratch the last block zeroes), "unclassified"
    problem: str | None = None  # a counter's contract broken: how


def lint(src: str, file: str = "<src>") -> list[Atomic]:
    """Every atomic call in `src`, classified, each arrival counter's reset checked."""
    text = strip_comments(src)
    found = []
    for f in functions(text):
        body = text[f.start:f.end + 1]
        for m in re.finditer(r"\b(atomic\w+)\s*\(", body):
            op, call = m.group(1), f.start + m.end() - 1
            args = args_of(text, call)
            after = text[matching(text, call) + 1:]
            flag = re.search(r"(\w+)\s*=\s*$", text[f.start:f.start + m.start()])
            if op in COUNTER_OPS and re.match(r"\s*==", after) and flag:
                a = Atomic(file, f.name, op, args[0], "counter")
                a.problem = counter_problem(text, f, f.start + m.start(), flag.group(1), args[0])
            elif op in ("atomicMax", "atomicMin") and (c := re.search(
                    r"(\w+)\s*=\s*atomic(?:Add|Inc)\s*\([^;]*\)\s*==", text[call:f.end])):
                # a keyed reduction into scratch: the last block to arrive at the counter after it must zero it
                a = Atomic(file, f.name, op, args[0], "keyed")
                a.problem = counter_problem(text, f, call + c.start(), c.group(1), args[0])
            elif op == "atomicExch" and re.fullmatch(r"0u?", args[-1]):
                a = Atomic(file, f.name, op, args[0], "reset")  # a counter set back to zero
            elif (base := re.match(r"\s*\(?\s*(\w+)", args[0])) and re.search(
                    r"__shared__\s[^;]*\b" + base.group(1) + r"\s*\[", body):
                # a block's own shared array (a histogram): it lives for the launch alone; the function must zero it
                zeroed = re.search(r"\b" + base.group(1) + r"\s*\[[^\]]*\]\s*=\s*0(?:u|ull)?\s*;", body)
                a = Atomic(file, f.name, op, args[0], "shared",
                           None if zeroed else f"an atomic into the shared array `{base.group(1)}`, which the "
                           f"function never sets to zero (shared memory starts undefined in every launch)")
            elif op == "atomicAdd" and (c := re.search(
                    r"(\w+)\s*=\s*atomic(?:Add|Inc)\s*\([^;]*\)\s*==", text[call:f.end])):
                # a ticket or an uncounted arrival (chain.cu: a block's place in a ticket-ordered launch, a phase's
                # arrivals a later phase waits on): the last block to arrive at the function's arrival counter after
                # it must zero it, as a keyed reduction's
                a = Atomic(file, f.name, op, args[0], "ticket")
                a.problem = counter_problem(text, f, call + c.start(), c.group(1), args[0])
            else:
                a = Atomic(file, f.name, op, args[0], "unclassified",
                           "an atomic that is not an arrival counter (`last = atomicAdd(c, 1u) == n - 1`): classify it "
                           "in tests/test_kernel_lint.py (a reduction into an output must have that output zeroed "
                           "before every launch, a CUDA graph replay included)")
            found.append(a)
    return found


def counter_problem(text: str, f: Function, at: int, flag: str, ptr: str) -> str | None:
    """Why the arrival counter `ptr` (its atomic at `at`, its verdict in `flag`) is not left zero, or None."""
    gate = re.compile(r"if\s*\(\s*!\s*" + re.escape(flag) + r"\s*\)\s*(return|continue)\s*;|if\s*\(\s*" +
                      re.escape(flag) + r"\s*\)\s*\{")
    g = gate.search(text, at, f.end)
    if g is None:
        return f"no gate on `{flag}` after the atomic: no block is singled out as the last to arrive"
    if g.group(1):  # `if (!last) return|continue;`: the rest of the gate's own block is the last block's
        lo, hi = enclosing_block(text, f.start, g.start())[0], None
        hi = enclosing_block(text, f.start, g.start())[1]
        lo = g.end()
    else:  # `if (last) { ... }`
        lo = g.end() - 1
        hi = matching(text, lo, "{", "}")
    region = text[lo:hi]
    squeezed, where = [], []  # the region without spaces, and each kept character's index in the region
    for k, c in enumerate(region):
        if not c.isspace():
            squeezed.append(c)
            where.append(k)
    s = "".join(squeezed)
    r = None
    for pat in reset_forms(ptr):
        r = re.search(pat, s)
        if r:
            break
    if r is None:
        return f"`{ptr}` is never set back to zero by the last block (after `{g.group(0).strip()}`)"
    between = region[:where[r.start()]]
    leave = re.search(r"\b(return|break|continue)\b", between)
    if leave:
        return f"a `{leave.group(1)}` between the gate and the reset of `{ptr}` leaves it non-zero on that path"
    return None


def sources() -> dict[str, str]:
    here = resources.files("lanefuse.kernels")
    return {p.name: p.read_text() for p in sorted(here.iterdir(), key=lambda p: p.name) if p.name.endswith(".cu")}


def all_atomics() -> list[Atomic]:
    return [a for name, src in sources().items() for a in lint(src, name)]


def test_every_atomic_in_the_kernels_is_an_arrival_counter_reset_by_its_last_block():
    found = all_atomics()
    bad = [f"{a.file}:{a.function}: {a.op}({a.ptr}, ...): {a.problem}" for a in found if a.problem]
    assert not bad, "\n".join(bad)
    # the counters the sources keep (a new one is welcome: it is checked above; this says the lint still sees them)
    counters = {(a.file, a.function) for a in found if a.kind == "counter"}
    assert {("argmax.cu", "argmax_rows"), ("fold.cu", "fold_tail"), ("parts_rope.cu", "parts_epilogue"),
            ("moe.cu", "moe_down"), ("quant.cu", "slab_quant_tail"), ("delta.cu", "delta_body")} <= counters, counters


GOOD = """
__device__ void tail(unsigned* counter, float* y) {
    __shared__ int last;
    __threadfence();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    y[0] = 1.f;
    if (threadIdx.x == 0) *counter = 0u;
}
"""


KEYED = """
__device__ void keyed(unsigned long long* keys, unsigned* counter, int* out, int m) {
    __shared__ int last;
    for (int r = threadIdx.x; r < m; r += blockDim.x) atomicMax(keys + r, 5ull);
    __threadfence();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    for (int r = threadIdx.x; r < m; r += blockDim.x) {
        out[r] = (int)keys[r];
        keys[r] = 0ull;
    }
    if (threadIdx.x == 0) *counter = 0u;
}
"""


# chain.cu's form: a ticket (its value kept), the first phase's uncounted arrivals, the second phase's gated last block
TICKET = """
__device__ void chained(unsigned* c, float* y, unsigned g1) {
    __shared__ unsigned ticket;
    __shared__ int last;
    if (threadIdx.x == 0) ticket = atomicAdd(c, 1u);
    __syncthreads();
    if (ticket < g1) {
        if (threadIdx.x == 0) atomicAdd(c + 1, 1u);
        return;
    }
    if (threadIdx.x == 0) last = atomicAdd(c + 1, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    y[0] = 1.f;
    if (threadIdx.x == 0) {
        c[0] = 0u;
        c[1] = 0u;
    }
}
"""


@pytest.mark.parametrize("name,src,says", [
    ("no reset", GOOD.replace("if (threadIdx.x == 0) *counter = 0u;", ""), "never set back to zero"),
    ("reset before the gate", GOOD.replace("if (!last) return;", "*counter = 0u; if (!last) return;")
     .replace("if (threadIdx.x == 0) *counter = 0u;\n}", "}"), "never set back to zero"),
    ("another element", GOOD.replace("atomicAdd(counter, 1u)", "atomicAdd(counter + blockIdx.y, 1u)"),
     "never set back to zero"),
    ("a return on the way", GOOD.replace("y[0] = 1.f;", "if (y[1] > 0.f) return;"), "a `return` between"),
    ("no gate", GOOD.replace("if (!last) return;", ""), "no gate"),
    ("a float reduction", GOOD.replace("y[0] = 1.f;", "atomicAdd(y, 1.f);"), "not an arrival counter"),
    ("a keyed max never zeroed", KEYED.replace("keys[r] = 0ull;", ""), "never set back to zero"),
    ("a ticket never zeroed", TICKET.replace("c[0] = 0u;", ""), "never set back to zero"),
    ("a ticket zeroed before the gate", TICKET.replace("if (!last) return;", "c[0] = 0u; if (!last) return;")
     .replace("        c[0] = 0u;\n", ""), "never set back to zero"),
    ("a ticket without a counter after it", "__device__ void k(unsigned* c) { unsigned t = atomicAdd(c, 1u); }",
     "not an arrival counter"),
    ("a keyed max without a counter after it", "__device__ void k(unsigned long long* keys) {\n"
     " atomicMax(keys, 1ull);\n}", "not an arrival counter"),
    ("a shared histogram never zeroed", "__device__ void h(const int* x) { __shared__ unsigned long long hist[256];\n"
     " atomicAdd(hist + (x[threadIdx.x] & 255), 1ull);\n}", "never sets to zero"),
    ("a loop's reset outside the loop",
     "__device__ void t(unsigned* c, int n) { __shared__ int last;\n for (int r = 0; r < n; r++) {\n"
     "  if (threadIdx.x == 0) last = atomicAdd(c + r, 1u) == 3u; __syncthreads();\n  if (!last) continue;\n }\n"
     " c[r] = 0u;\n}", "never set back to zero"),
])
def test_the_lint_catches(name, src, says):
    problems = [a.problem for a in lint(src) if a.problem]
    assert problems and says in problems[0], (name, problems)


def test_the_lint_passes_the_forms_the_kernels_use():
    forms = [GOOD,
             GOOD.replace("if (!last) return;\n    y[0] = 1.f;\n    if (threadIdx.x == 0) *counter = 0u;",
                          "if (last) { y[0] = 1.f; if (threadIdx.x == 0) counter[0] = 0u; }"),
             "__device__ void t(unsigned* arrivals, int n) { __shared__ int last;\n for (int r = 0; r < n; r++) {\n"
             "  if (threadIdx.x == 0) last = atomicAdd(arrivals + r * (n >> 8) + 1, 1u) == 3u; __syncthreads();\n"
             "  if (!last) continue;\n  if (threadIdx.x == 0) arrivals[r * (n >> 8) + 1] = 0u;\n }\n}",
             "#define K(NAME) \\\n extern \"C\" __global__ void NAME(unsigned* c) { \\\n  __shared__ int last; \\\n"
             "  last = atomicInc(c, 9u) == 9u; /* a comment's } brace */ \\\n  if (!last) return; \\\n"
             "  atomicExch(c, 0u); \\\n }\nK(k1)\n", TICKET]
    for src in forms:
        found = lint(src)
        assert [a.kind for a in found if a.kind not in ("reset", "ticket")] == ["counter"], (src, found)
        assert not [a for a in found if a.problem], (src, found)
    found = lint(KEYED)
    assert [a.kind for a in found] == ["keyed", "counter"] and not any(a.problem for a in found), found


# -- the Python side: counters declared, passed, kept apart ----------------------------------------------------------

def kernel_params(src: str) -> dict[str, list[str]]:
    """{kernel: [parameter declarations]} of an `extern "C" __global__` kernel source after the C preprocessor
    (the kernels' macros expand parameter lists and whole kernels); the kernels include no header."""
    cpp = shutil.which("cpp")
    r = subprocess.run([cpp, "-P", "-x", "c++", "-"], input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    out = {}
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(', text):
        out[m.group(1)] = args_of(text, m.end() - 1)
    return out


def is_counter_param(decl: str) -> bool:
    return re.match(r"(?:const\s+)?unsigned(?:\s+int|\s+long\s+long)?\s*\*", decl) is not None  # a keyed max's too


class Marked(np.ndarray):
    """An array the recording env hands out, saying what it is: ("scratch", Scratch) or ("array", name)."""

    what: tuple = ("?",)


def recording_env():
    from test_kernels_compile import RecordingEnv

    class Env(RecordingEnv):
        def scratch(self, launch, s):
            a = np.zeros(max(s.nbytes // 4, 1), np.uint32).view(Marked)
            a.what = ("scratch", s)
            return a

        def array(self, name):
            a = np.zeros(4, np.float32).view(Marked)
            a.what = ("array", name)
            return a

    return Env()


def counter_samples():
    """Variants keeping a counter that test_kernels_compile's samples do not reach: a fold's GEMV four outputs a warp
    and over a quantized activation, the quantizing tails a warp an output, the delta rule's q8k tail at each width,
    the split attention's merge in its kernel for heads of 256, in the narrow kernel (heads of 32, a q8k block's 8
    a block) and in the shared-row kernel."""
    from lanefuse.kernels import Advance, ArgMax, Attention, Delta, Dst, Fold, Gemv, GemvGlu, Moe, Norm

    tail = dict(add="o", sum="s")
    return [Fold(Gemv("x", "w", "bf16", Dst("o"), 64, 64, 1, per_warp=4), Norm("r", "w2", "y", 1, 64, 1e-6, **tail)),
            Fold(Gemv("xq", "w", "q8_0", Dst("o"), 64, 64, 1, words=1), Norm("r", "w2", "y", 1, 64, 1e-6, **tail)),
            GemvGlu("x", "wg", "wu", "bf16", "o", 32, 64, 1, per_warp=1, quant="oq", quant_words=1),
            Gemv("x", "w", "bf16", Dst("o"), 64, 64, 9, per_warp=1, quant="oq", quant_words=2),
            *(Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 8, dk, 64, 3, 0.17, 1e-6, quant="oq", words=3,
                    seqs=seqs) for dk in (64, 96, 128) for seqs in (False, True)),
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 256, 256, 16, 1, 0.06, splits=2, per_block=2),
            Attention("q", "kc", "vc", "pos", "o", 16, 4, 32, 32, 16, 1, 0.2, splits=3, per_block=4, quant="oq",
                      words=3),
            # the shared-row kernel's merge (two rows of two heads a block, issue 40 item 4)
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 64, 64, 16, 3, 0.1, splits=3, per_block=2, shared=2),
            # the LM head and its arg-max in one launch (head_argmax): the keys and the arrivals, both counters
            *(Fold(Gemv("x", "w", "bf16", Dst("o"), 64, 64, m, per_warp=pw, words=wd),
                   ArgMax("o", "t", 64, m, Advance("tok", "pos", batch=m > 1)))
              for m, pw, wd in ((1, 4, 0), (3, 1, 0), (2, 1, 1))),
            # a batch's entry at the narrowest width (delta_seqs_32: each row a sequence of its own, issue 40)
            Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 8, 32, 64, 3, 0.17, 1e-6, quant="oq", words=3,
                  seqs=True),
            # the mixture's routing as phase 0 of its launch (moe_up_split: tickets, arrivals and flags, issue 40)
            Moe("x", "wr", "wgu", "wd", Dst("y"), 64, 64, 40, 2, 2, "bf16", router_split=2)]


def test_every_counter_parameter_is_passed_a_counter_scratch():
    """Each kernel call the sample launches make (test_kernels_compile's samples: every kind, its variants): a
    counter parameter gets a scratch declared `counter=True` (or a null pointer where the variant keeps none), and a
    counter scratch goes to a counter parameter only: a counter in the arena would be neither zero before the launch
    nor its own."""
    if shutil.which("cpp") is None:
        pytest.skip("no C preprocessor (cpp) to expand the kernels' macros")
    from lanefuse.kernels.compile import source
    from test_kernels_compile import samples

    env = recording_env()
    for launch in samples() + counter_samples():
        launch.cuda(env)
    params: dict[tuple, dict] = {}
    counted = set()
    for stems, name, grid, block, args in env.calls:
        if stems not in params:
            params[stems] = kernel_params(source(stems))
        decls = params[stems][name]
        assert len(decls) == len(args), (name, decls, len(args))
        for decl, a in zip(decls, args):
            what = getattr(a, "what", None)
            if is_counter_param(decl):
                null = isinstance(a, np.uint64) and int(a) == 0
                assert null or (what and what[0] == "scratch" and what[1].counter), \
                    f"{name}: its counter `{decl}` is passed {what or a!r}, not a counter scratch"
                counted.add(name) if not null else None
            elif what and what[0] == "scratch":
                assert not what[1].counter, f"{name}: counter scratch {what[1].tag} passed as `{decl}`"
    every = {k for p in params.values() for k, d in p.items() if any(is_counter_param(x) for x in d)}
    assert counted == every, f"kernels with a counter no sample passes one: {sorted(every - counted)}"


def test_the_sources_use_unsigned_pointers_for_counters_alone():
    """The check above reads `unsigned*` as "a counter": every unsigned pointer a kernel source declares is one of
    the counter names."""
    for name, src in sources().items():
        for m in re.finditer(r"\bunsigned(?:\s+long\s+long)?\s*\*\s*(\w+)", strip_comments(src)):
            assert m.group(1) in ("counter", "counters", "arrivals", "head_arrivals", "c", "keys"), \
                f"{name}: unsigned* {m.group(1)}"


def plans():
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from test_quant import q8_model

    cfg, w = demo_model()
    qcfg, qw = q8_model("q8_0")
    return [(plan(build_step(cfg, 1)), w), (plan(build_step(cfg, 4)), w),
            (plan(build_step(qcfg, 1), numerics="q8"), qw)]


@pytest.fixture(scope="module")
def planned():
    return plans()


def test_plans_keep_counters_out_of_the_arena(planned):
    for s, _ in planned:
        assert s.counters, "the plan keeps no counter: the check would prove nothing"
        arena = {p.name for p in s.arena.arrays}
        for i, tag, nbytes in s.counters:
            sc = {x.tag: x for x in s.launches[i].launch.scratch()}[tag]
            assert sc.counter and nbytes == sc.nbytes
            assert f"#{i}.{tag}" not in arena, f"counter {tag} of launch {i} placed in the arena"


def test_the_device_env_gives_each_counter_its_own_zeroed_buffer(planned, monkeypatch):
    """Through the CuPy runner on a stand-in cupy (test_cupy_runner_mock's): every counter buffer is zero, and shares
    memory with no arena view, no other scratch and no other array; arena scratch stays in the arena."""
    import sys

    from test_cupy_runner_mock import _fake_cupy

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    for s, w in planned:
        r = CupyRunner(s, w, DeviceState(), graph=False)
        env = r.env
        by_key = {(x.launch.key(), sc.tag): sc for x in s.launches for sc in x.launch.scratch()}
        for x in s.launches:  # what the runner allocates before capture, asked once more: the same buffers
            for sc in x.launch.scratch():
                env.scratch(x.launch, sc)
        counters = {k: a for k, a in env._scratch.items() if by_key[k].counter}
        assert counters and len(counters) == len({(s.launches[i].launch.key(), t) for i, t, _ in s.counters})
        others = [a for k, a in env._scratch.items() if k not in counters] + list(env.views.values())
        for k, a in counters.items():
            assert not np.asarray(a).any(), f"counter {k} not zeroed"
            assert not np.shares_memory(np.asarray(a), np.asarray(env.arena)), f"counter {k} in the arena"
            for b in others + [c for j, c in counters.items() if j != k]:
                assert not np.shares_memory(np.asarray(a), np.asarray(b)), f"counter {k} shares memory"


def state(env) -> list[np.ndarray]:
    """Everything a numpy twin can write: the arena's bytes, the cache tables, the step's inputs and outputs."""
    return [env.arena.copy(), *(t.copy() for _, t in sorted(env.tables.items())),
            *(a.copy() for _, a in sorted(env.io.items()))]


def test_each_launch_twice_in_a_row_writes_the_same(planned):
    """The numpy twin's side of the protocol: each launch of a plan, run a second time right after the first (as a
    graph replay runs it), leaves the arena, the caches and the step's inputs and outputs as the first run left them,
    bit for bit. The one launch allowed to differ is the arg-max advancing the position it reads (a decode loop on the
    device), alone or at the end of the LM head's fold."""
    from lanefuse.kernels import ArgMax
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    for s, w in planned:
        run = NumpyRunner(s, w)
        env = run.env
        rows = s.tensors[s.io.token].size
        g = np.random.default_rng(0)
        env.tables = {n: g.standard_normal(s.tensors[n].size).astype(np.float32) for n in s.io.tables}
        env._views.clear()
        env.array(s.io.token)[:] = np.arange(1, rows + 1, dtype=np.int32)
        env.array(s.io.position)[:] = 3
        counted = 0
        for i, x in enumerate(s.launches):
            l = x.launch
            l.numpy(env)
            once = state(env)
            l.numpy(env)
            twice = state(env)
            counted += bool(l.scratch() and any(sc.counter for sc in l.scratch()))
            a = getattr(l, "then", l)  # the arg-max's own launch, or the LM head's fold ending with it (head_argmax)
            if isinstance(a, ArgMax) and a.advance is not None:
                assert int(env.array(s.io.position)[0]) == 3 + 2 * a.advance.step
                continue
            for a, b in zip(once, twice):
                assert np.array_equal(a, b, equal_nan=True), f"launch {i} ({l.census}) wrote other values the second time"
        assert counted >= 2, "the plan runs fewer than two launches keeping a counter"
