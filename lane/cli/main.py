"""The `lanefuse` command: run, plan, rules, check, kernels, explore. User errors end in one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import os
import sys

from lanefuse.engine.errors import UserError, one_line
from lanefuse.kernels.prebuilt import ARCH_CHOICES
from lanefuse.lane.lower.plan import NUMERICS

EPILOG = ("MODEL is a checkpoint folder (config.json + safetensors), a GGUF file (or a folder holding one), a step "
          "YAML, or nothing for the built-in demo model.")


def _version() -> str:
    from lanefuse.engine.version import version

    return version()


def _explore_epilog() -> str:
    """The shell's commands, from the list its `help` prints."""
    from lanefuse.lane.explore.shell import COMMANDS

    w = max(len(u) for u, _ in COMMANDS)
    lines = ["commands of the explorer's shell (`help` in it lists them too):"]
    lines += [f"  {u:<{w}}  {what}" for u, what in COMMANDS]
    return "\n".join(lines) + "\n\n" + EPILOG


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a port (0..65535; 0 picks a free one)")
    return v


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", help="checkpoint folder, .gguf file, step YAML, or omit for the demo "
                                                              "model")


def _jobs(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of compiles") from None
    if not 1 <= v <= 256:
        raise argparse.ArgumentTypeError(f"{v}: give 1 to 256 compiles at a time")
    return v


def _rows(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rows") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: give at least 1 row")
    return v


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", "-c", "--ctx-size", dest="ctx", type=_rows, default=None, metavar="N",
                   help="KV cache rows: the positions a run can reach (default: what the model allows, at most "
                        "4096 and a quarter of memory; said in the output)")
    p.add_argument("--weights-format", default=None,
                   choices=("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "q4_1", "q5_0", "q5_1", "q5_k",
                            "q3_k", "q2_k", "iq4_nl", "iq4_xs"),
                   help="a folder holding only config.json: the checkpoint format to plan its weights in (default: "
                        "the config's torch_dtype); the demo model: its matrices stored (quantized) in that format")


def _rank_count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: give at least 1 rank")
    return v


def _ranks_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ranks", type=_rank_count, default=1, metavar="R", help=f"tensor parallel over R ranks: {what} "
                   f"(the dense Llama / Mistral / Qwen2 / Qwen3 decoders; R divides the KV heads)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    _shape_args(p)
    p.add_argument("--hold", action="append", default=[], metavar="RULE",
                   help="hold a fusion rule or schedule step back (repeatable)")
    p.add_argument("--rules", action="append", default=[], metavar="DIR",
                   help="add the rule YAML files of DIR to the table (repeatable; also $LANEFUSE_RULES)")
    p.add_argument("--lane", default=None, metavar="LANE", help="the lane table to plan for (default: cuda)")
    p.add_argument("--numerics", default=None, choices=NUMERICS, help="activation numerics (default f32)")
    p.add_argument("--spec", metavar="FILE", help="a plan file (YAML: lane, numerics, held rules, knobs, forced "
                                                  "choices) to replay")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE", help="set a lane knob (repeatable)")


# llama-cli's common flags lanefuse does not take, and what it has instead (said where one is given)
LLAMA_FLAGS = {
    "-ngl": "the whole step runs on the device with --device gpu (no layer split)",
    "--n-gpu-layers": "the whole step runs on the device with --device gpu (no layer split)",
    "-t": "the CPU backend uses numpy's BLAS threads (OMP_NUM_THREADS)",
    "--threads": "the CPU backend uses numpy's BLAS threads (OMP_NUM_THREADS)",
    "-f": "--prompts FILE takes a batch of prompts, one a line; a text prompt: -p TEXT",
    "--file": "--prompts FILE takes a batch of prompts, one a line; a text prompt: -p TEXT",
    "-b": "--batch B is the sequences decoded together; the prompt is prefilled in chunks (--knob chunk_rows=N)",
    "--repeat-penalty": "sampling takes --temp, --top-k, --top-p, --min-p and --seed",
    "--typical": "sampling takes --temp, --top-k, --top-p, --min-p and --seed",
    "-cnv": "run generates once; `--chat -p TEXT` puts one user message through a GGUF chat template",
    "--conversation": "run generates once; `--chat -p TEXT` puts one user message through a GGUF chat template",
    "-i": "run generates once; `--chat -p TEXT` puts one user message through a GGUF chat template",
    "--interactive": "run generates once; `--chat -p TEXT` puts one user message through a GGUF chat template",
    "-e": "-p TEXT is taken as it is (no escapes processed)",
    "--color": "the streamed text is plain",
}


def llama_hint(message: str) -> str:
    """For `unrecognized arguments: ...` naming a llama-cli flag: what lanefuse has instead."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag in LLAMA_FLAGS:
            return f" ({flag} is llama-cli's; lanefuse does not take it: {LLAMA_FLAGS[flag]})"
    return ""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its refusals (an invalid choice echoes the value given) on one short line, with a hint
    where the flag is a llama-cli one lanefuse does not take."""

    def error(self, message):
        import re

        # an option with aliases named by its long name alone: `argument --ctx: ...`, not `--ctx/-c/--ctx-size`
        message = re.sub(r"^argument ([-\w]+(?:/[-\w]+)+):",
                         lambda m: "argument " + next((o for o in m.group(1).split("/") if o.startswith("--")),
                                                      m.group(1)) + ":", message)
        super().error(one_line(message) + llama_hint(message))


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="lanefuse",
        description="Compile one step of LLM inference (a decode step or a prefill chunk) into fused GPU kernel "
                    "launches with a rule-table driven e-graph engine, and run it.",
        epilog=EPILOG)
    ap.add_argument("--version", action="version", version=f"lanefuse {_version()}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    p = sub.add_parser("run", help="generate tokens with a fused plan (or the reference interpreter)",
                       description="Prefill the prompt in chunks, then decode --tokens tokens (greedy unless --temp), "
                                   "each written to stdout as its step ends; the timings on stderr. llama-cli's "
                                   "-m, -p, -n, -c, -s, --temp, --top-k, --top-p and --min-p are taken.",
                       epilog=EPILOG)
    _model_arg(p)
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="MODEL, as llama-cli takes it")
    p.add_argument("--prompt-ids", metavar="IDS", action="append", default=None,
                   help="comma-separated prompt token ids, e.g. 1,2,3 (repeatable: a batch of prompts)")
    p.add_argument("--prompts", metavar="FILE", help="a batch of prompts, one a line: a JSON list of ids, or "
                                                     "{\"prompt\": TEXT} (needs the model's tokenizer)")
    p.add_argument("--batch", type=_rows, default=None, metavar="B",
                   help="slots decoded together (default: the number of prompts, at most 64); a sequence that ends "
                        "gives its slot to the next waiting prompt")
    p.add_argument("--ignore-eos", action="store_true",
                   help="a batch's sequences run their --tokens past the end-of-sequence id the config names")
    p.add_argument("-p", "--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json in the folder, or a GGUF "
                                                    "file's tokenizer, and the `tokenizers` package)")
    p.add_argument("--chat", action="store_true", help="put --prompt TEXT (and each text line of --prompts) through "
                   "the GGUF file's chat template as one user message (tokenizer.chat_template; needs jinja2)")
    p.add_argument("-n", "--tokens", "--n-predict", dest="tokens", type=int, default=16, metavar="N",
                   help="tokens to generate (default 16)")
    s = p.add_argument_group("sampling (default greedy: the plan's arg-max; else the step's closing launch draws, "
                             "Philox keyed by the seed, as transformers' logits processors define each)")
    s.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.0, metavar="T",
                   help="temperature (default 0: greedy)")
    s.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0: off)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="keep the most likely tokens whose probabilities sum to P (1: off)")
    s.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep the tokens at least P times as likely as the most likely one (0: off)")
    s.add_argument("-s", "--seed", type=int, default=0, metavar="N",
                   help="the draws' seed (Philox, counter-based: the same seed, the same tokens; default 0)")
    p.add_argument("--json", metavar="FILE", help="write {model, prompt_ids, generated_ids, logits} to FILE (`-`: "
                                                  "stdout, the other lines then go to stderr)")
    p.add_argument("--reference", action="store_true", help="run the reference interpreter of the lifted graph")
    p.add_argument("--exact", action="store_true",
                   help="the numpy backend's exact twins (each kernel's sums as it makes them; under --numerics q8 "
                        "llama.cpp's CPU arithmetic, its logits to the bit) in place of the fast ones; slower (the "
                        "default on the CPU under --numerics q8)")
    p.add_argument("--fast-twins", action="store_true",
                   help="under --numerics q8 on the CPU, the numpy backend's fast twins (f32 BLAS on decoded rows, "
                        "about 4-5x faster a decode token, 11-13x a prompt's chunk) in place of the exact ones: "
                        "llama.cpp's numbers no longer to the bit (0.1-0.4 apart in the logits, the greedy tokens "
                        "apart within a few steps at depth)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"],
                   help="auto: CuPy when a CUDA device is present, numpy otherwise")
    p.add_argument("--plan", metavar="FILE", help="run a plan saved by `lanefuse plan --save` (no solver needed)")
    _ranks_arg(p, "R processes of this machine (gloo), each its rank's step")
    _plan_args(p)

    p = sub.add_parser("plan", help="plan a step: launches, census, fusions fired, arena, estimated cost",
                       description="Optimize the step graph under the lane and print the plan.", epilog=EPILOG)
    _model_arg(p)
    p.add_argument("--rows", type=int, default=1, metavar="R", help="rows of the step: 1 = decode, >1 = prefill chunk")
    p.add_argument("--batch", type=_rows, default=1, metavar="B",
                   help="the decode step of a batch of B sequences (one row each, each over its own cache slot)")
    _last_arg(p)
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON to FILE (`-`: stdout, nothing else printed); "
                                                  "FILE is required, so `--json` never takes MODEL for its file")
    p.add_argument("--trace", metavar="FILE", help="write the rewrite trace as JSON to FILE")
    p.add_argument("--save", metavar="FILE", help="save the plan for `lanefuse run --plan FILE`")
    _ranks_arg(p, "each rank's weight and cache bytes, whether they fit a device, its step's collectives")
    p.add_argument("--html", metavar="DIR", help="write a static report of the plan into DIR (made if missing): "
                                                 "open DIR/index.html from the file system, no server needed")
    p.add_argument("--lifted", action="store_true", help="print the lifted graph instead (op, inputs, output, shape)")
    p.add_argument("--layer", type=int, default=None, metavar="N", help="show layer N's launches (-1: the step's "
                                                                        "tail)")
    p.add_argument("--all", "-v", "--verbose", dest="all", action="store_true",
                   help="every table in full: the census, every rule (those that matched nothing too), layer 0's "
                        "launches (the default is a summary)")
    _plan_args(p)

    p = sub.add_parser("rules", help="list the fusion rule table, or check a rules folder",
                       description="List every rule: name, class, source file:line, rules it depends on.")
    p.add_argument("--rules", action="append", default=[], metavar="DIR", help="add a user rules folder")
    p.add_argument("--check", nargs="?", const="", metavar="DIR",
                   help="validate the table (and DIR) and say which classes no lane links")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the table as JSON to FILE (alone or `-`: stdout, nothing else printed)")

    p = sub.add_parser("check", help="check the fused plans against the reference interpreter, launch by launch",
                       description="Plan the decode step and a prefill chunk, run each plan on the numpy backend "
                                   "(every step-local array in its arena) beside the reference interpreter of the "
                                   "lifted graph, and name the first launch that diverges.", epilog=EPILOG)
    _model_arg(p)
    p.add_argument("--rows", type=int, action="append", metavar="R",
                   help="step rows to check (repeatable; default 1 and 8)")
    _last_arg(p)
    p.add_argument("--device", default="cpu", choices=["cpu"], help="the backend checked (numpy)")
    _ranks_arg(p, "R ranks' step (the reference interpreter's) against one rank's")
    _plan_args(p)

    p = sub.add_parser("kernels", help="list the CUDA kernel modules, or compile them ahead of time (--build DIR)",
                       description="Every CUDA kernel module the launch kinds compile. --build DIR compiles each to a "
                                   "cubin for --arch (nvcc, or NVRTC through cuda-python: no GPU needed), several at "
                                   "a time; with LANEFUSE_CUBINS=DIR the CuPy runner loads them instead of compiling "
                                   "each at a process's first launch (the decode modules take minutes in ptxas).")
    p.add_argument("--build", metavar="DIR", help="compile every module (or each --module) to DIR/KEY.cubin")
    p.add_argument("--arch", default="sm_90", choices=ARCH_CHOICES, help="the GPU arch (default sm_90: H100/H200)")
    p.add_argument("--compiler", default="auto", choices=("auto", "nvcc", "nvrtc"),
                   help="nvcc, or NVRTC through cuda-python as CuPy compiles (auto: nvcc where it is on PATH)")
    p.add_argument("--jobs", "-j", type=_jobs, default=os.cpu_count() or 1, metavar="N",
                   help="compiles at a time (default: the CPUs)")
    p.add_argument("--module", action="append", metavar="NAME",
                   help="only this module (its name as listed; repeatable)")
    p.add_argument("--force", action="store_true", help="rebuild cubins already in DIR")

    p = sub.add_parser("explore", help="explore fusion choices interactively (terminal, or --web in a browser)",
                       description="Explore the fusion choices of a step: a command loop in the terminal (scripted "
                                   "where stdin is not a terminal), or --web: the same on a local page.",
                       epilog=_explore_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_arg(p)
    p.add_argument("--web", action="store_true", help="serve the explorer page on 127.0.0.1")
    p.add_argument("--port", type=_port, default=0, help="port for --web (default: a free one)")
    p.add_argument("--rows", type=int, default=1, metavar="R", help="rows of the step (1 = decode)")
    p.add_argument("--exact", action="store_true",
                   help="re-plan every change exactly (the ILP), not by local search (`exact on` in the shell)")
    _plan_args(p)
    return ap


OUTPUTS = ("json", "save", "trace")  # the flags that name a file lanefuse writes
INPUTS = ("model", "spec", "plan", "prompts")  # the flags that name a file it reads


def check_outputs(args) -> None:
    """Refuse, before any work starts, an output path that cannot be written (a folder, a missing or read-only folder),
    one that would overwrite an input (MODEL, --spec, --plan) or another output, and a JSON file named `.yaml`/`.yml`
    (a step YAML it would destroy: `--json MODEL` was meant as MODEL)."""
    import os

    from lanefuse.lane.lower.files import check_output_path

    seen: dict[str, str] = {}
    for flag in OUTPUTS:
        path = getattr(args, flag, None)
        if not isinstance(path, str):
            continue
        if path == "-":  # stdout takes one output, whole
            if "-" in seen:
                raise UserError(f"--{flag} -: --{seen['-']} already writes to stdout; give one of them a file")
            seen["-"] = flag
            continue
        if path.lower().endswith((".yaml", ".yml")):
            raise UserError(f"--{flag} {path}: a JSON output must not be named .yaml/.yml (is it MODEL? write "
                            f"`lanefuse {args.cmd} {path} --{flag} FILE.json`, or `--json -` for stdout)")
        check_output_path(path, f"--{flag}")
        real = os.path.realpath(path)
        for inp in INPUTS:
            src = getattr(args, inp, None)
            if isinstance(src, str) and os.path.exists(src) and os.path.realpath(src) == real:
                raise UserError(f"--{flag} {path}: is the {'MODEL' if inp == 'model' else '--' + inp} file it reads; "
                                f"give another output name")
        if real in seen:
            raise UserError(f"--{flag} {path}: --{seen[real]} writes the same file; give each its own name")
        seen[real] = flag
    html = getattr(args, "html", None)
    if isinstance(html, str):  # a folder: made if missing, never a file
        if os.path.exists(html) and not os.path.isdir(html):
            raise UserError(f"--html {html}: is a file; give a folder for the report (it is made if missing)")
        if html == "-":
            raise UserError("--html -: the report is a folder of files; give a folder name")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a closed pipe says nothing (and exits 0)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's capture): nothing to flush later
        pass


def _llama_flags(ap: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse a llama-cli flag lanefuse does not take before argparse reads it as a short option and its value
    (`-ngl 99` as `-n gl`, `-cnv` as `-c nv`), saying what lanefuse has instead."""
    for word in argv:
        if word == "--":
            return
        flag = word.split("=", 1)[0]
        if flag in LLAMA_FLAGS:
            ap.error(f"unrecognized arguments: {word}")


def _last_arg(p) -> None:
    p.add_argument("--last", type=_rows, default=1, metavar="K",
                   help="the logits of the chunk's last K rows, not only its last row's (a verifier of K-1 drafted "
                        "tokens: a view of those rows of the residual, no launch); K at most the step's rows")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    _llama_flags(ap, sys.argv[1:] if argv is None else list(argv))
    args = ap.parse_args(argv)
    if not args.cmd:
        ap.print_help()
        return 2
    try:
        from lanefuse.lane.cli import commands

        check_outputs(args)
        rc = getattr(commands, "cmd_" + args.cmd)(args) or 0
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at the interpreter's exit
        return rc
    except UserError as e:
        print(f"lanefuse: error: {one_line(e)}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("lanefuse: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lanefuse plan | head -5`: the reader has what it wanted; end quietly, as git log does
        _quiet_stdout()
        return 0
    except Exception as e:  # a bug of lanefuse's, not the user's: one line, the traceback on request
        from lanefuse.engine import flags

        if flags.read("LANEFUSE_DEBUG") >= 1:
            raise
        print(f"lanefuse: internal error: {type(e).__name__}: {one_line(e)} (LANEFUSE_DEBUG=1 shows the traceback; "
              f"please report it)", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
