"""The `ninfer` command (docs/cli.md).

Each subcommand is one `Command` in `COMMANDS`: a function that adds its arguments to a parser
and a function that runs it and returns the exit status. User errors never show a traceback:
a handler raises `CliError` (or lets a `ConvertError` through) and `main` prints
`error: <message>` to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CliError", "Command", "COMMANDS", "main"]

# Exit statuses: 1 = the operation ran and found a problem (e.g. a checksum mismatch),
# 2 = the input was unusable (missing file, bad magic, unknown recipe, bad arguments).
EXIT_FAILED = 1
EXIT_USAGE = 2


class CliError(Exception):
    def __init__(self, message: str, status: int = EXIT_USAGE):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_convert(p: argparse.ArgumentParser) -> None:
    from ninfer.convert import RECIPES

    p.add_argument("source", help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("-o", "--output", required=True, help="artifact file to write (or an existing directory to write into)")
    p.add_argument(
        "--recipe",
        default="bf16",
        help="encodings to use: " + "; ".join(f"{r.name}: {r.description}" for r in RECIPES.values()),
    )
    p.add_argument(
        "--components",
        help="comma-separated components to include (text, mtp); default: text, plus mtp when present",
    )
    p.add_argument("--name", help="model name stored in the artifact (default: the source directory name)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress line and no warnings on stderr")


def _run_convert(args: argparse.Namespace) -> int:
    from ninfer.convert import convert

    comps = args.components.split(",") if args.components is not None else None
    report = convert(
        args.source,
        args.output,
        args.recipe,
        comps,
        name=args.name,
        overwrite=args.force,
        progress=not args.quiet,
    )
    if not args.quiet:
        print(f"{report['paths']['artifact']}  sha256 {report['sha256']}", file=sys.stderr)
        print(f"report: {report['paths']['conversion_json']}", file=sys.stderr)
    return 0


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".ninfer artifact")
    p.add_argument("--verify", action="store_true", help="check every tensor checksum (exit 1 on a mismatch)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_inspect(args: argparse.Namespace) -> int:
    from ninfer import _core
    from ninfer.convert.summary import format_summary, summarize

    try:
        art = _core.Artifact(args.file)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    if args.verify:
        try:
            art.verify()
        except ValueError as e:
            raise CliError(str(e), EXIT_FAILED) from None
    summary = summarize(art, args.file, verified=args.verify)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="a .ninfer artifact (default: the demo model bundled with ninfer)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default: auto)")
    p.add_argument("--max-context", type=int, default=8192, help="longest sequence in tokens")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation_config, else 1.0)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _open_engine(args: argparse.Namespace, **options: object):
    from ninfer import Engine

    try:
        return Engine(args.model, device=args.device, max_context=args.max_context, **options)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None


def _sampling(args: argparse.Namespace, engine):
    from ninfer import SamplingParams

    gen = engine.generation_config
    pick = lambda v, key, default: v if v is not None else gen.get(key, default)  # noqa: E731
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=pick(args.temperature, "temperature", 1.0),
        top_k=pick(args.top_k, "top_k", 0),
        top_p=pick(args.top_p, "top_p", 1.0),
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def _stream_to_stdout(engine, prompt, params) -> str:
    out = []
    try:
        for d in engine.stream(prompt, params):
            sys.stdout.write(d.text)
            sys.stdout.flush()
            out.append(d.text)
    except ValueError as e:
        raise CliError(str(e)) from None
    return "".join(out)


def _configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (raw, no chat template; see `ninfer chat`)")
    _add_engine_args(p)
    _add_sampling_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    engine = _open_engine(args)
    with engine:
        sys.stdout.write(args.prompt)
        _stream_to_stdout(engine, args.prompt, _sampling(args, engine))
        sys.stdout.write("\n")
    return 0


def _configure_chat(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-think", action="store_true", help="disable thinking (enable_thinking=false)")


def _run_chat(args: argparse.Namespace) -> int:
    from ninfer.parsers import parse_output

    engine = _open_engine(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"ninfer chat: {engine.path.name} on {engine.device}; an empty line or Ctrl-D ends", file=sys.stderr)
    with engine:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            prompt = engine.render_chat(messages, enable_thinking=not args.no_think)
            text = _stream_to_stdout(engine, prompt, _sampling(args, engine))
            print()
            reasoning, content, _ = parse_output(text, None, thinking=not args.no_think)
            messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})
    return 0


def _configure_perplexity(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--model", "-m", help="a .ninfer artifact (default: the bundled demo model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="backend (default: cpu, the reference)")
    p.add_argument("--context", type=int, default=512, help="window length in tokens")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: the context: no overlap)")
    p.add_argument("--json", action="store_true")


def _run_perplexity(args: argparse.Namespace) -> int:
    from ninfer.engine import default_model_path
    from ninfer.perplexity import perplexity

    model = args.model or str(default_model_path())
    try:
        text = open(args.file, encoding="utf-8").read()
        r = perplexity(model, text, args.context, args.stride, args.device)
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps({"perplexity": r.perplexity, "nll": r.nll, "tokens_scored": r.tokens_scored, "tokens": r.tokens_total, "windows": r.windows, "seconds": r.seconds, "tokens_per_second": r.tokens_per_second}))
    else:
        print(f"perplexity {r.perplexity:.4f} over {r.tokens_scored} tokens ({r.windows} windows of {args.context}), {r.tokens_per_second:.1f} tok/s")
    return 0


def _configure_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="also check whether this artifact fits in GPU memory")
    p.add_argument("--context", type=int, default=32768, help="context to plan for (tokens)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences to plan for")
    p.add_argument("--json", action="store_true")


def _run_doctor(args: argparse.Namespace) -> int:
    from ninfer.doctor import format_report, gather, to_json

    try:
        report = gather(args.model, args.context, args.concurrency)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(to_json(report) if args.json else format_report(report))
    return 0


def _configure_synth(p: argparse.ArgumentParser) -> None:
    from ninfer.synth import PRESETS

    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="which model's shapes and encodings")
    p.add_argument("-o", "--output", required=True, help="artifact file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")


def _run_synth(args: argparse.Namespace) -> int:
    import os

    from ninfer.synth import synth

    if os.path.exists(args.output) and not args.force:
        raise CliError(f"{args.output} already exists (use --force to replace it)")
    synth(args.preset, args.output, args.seed)
    return 0


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def _configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .ninfer artifact (e.g. from `ninfer synth`)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per figure (after one warm-up)")
    p.add_argument("--prefill", type=_ints, default=(512, 4096, 16384), help="prompt lengths for ppN")
    p.add_argument("--concurrency", type=_ints, default=(1, 4, 16), help="concurrent sequences for tg")
    p.add_argument("--tg-prompt", type=int, default=512, help="prompt length before decoding")
    p.add_argument("--tg-tokens", type=int, default=128, help="tokens decoded per sequence")
    p.add_argument("--profile", action="store_true", help="instead: time every kernel of a --tg-prompt prefill and of a batch-1 decode step after it (CUDA)")
    p.add_argument("--json", action="store_true")


def _run_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ninfer.bench import copy_bandwidth, format_profile, format_result, profile_steps, run_bench

    if args.profile:
        device = "cuda" if args.device == "auto" else args.device
        try:
            steps = profile_steps(args.model, device, args.tg_prompt)
        except (ValueError, FileNotFoundError) as e:
            raise CliError(str(e)) from None
        if args.json:
            print(json.dumps({k: [asdict(t) | {"gb_s": t.gb_s} for t in v] for k, v in steps.items()}, indent=1))
        else:
            bw = copy_bandwidth("cuda") / 1e9
            for kind, times in steps.items():
                if kind == "prefill":
                    what = f"the {args.tg_prompt}-token prefill, eager"
                else:
                    what = f"one decode step after {args.tg_prompt} tokens, a CUDA graph with timing events between launches"
                print(f"{what}, kernel by kernel:\n{format_profile(times, bw)}\n")
        return 0
    try:
        r = run_bench(args.model, args.device, args.reps, args.prefill, args.concurrency, args.tg_prompt, args.tg_tokens)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    print(json.dumps(asdict(r), indent=1) if args.json else format_result(r))
    return 0


def _configure_serve(p: argparse.ArgumentParser) -> None:
    import os

    p.add_argument("model", nargs="?", help=".ninfer artifact to serve (default: the bundled demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--model-id", help="model name clients send (default: the artifact file name without .ninfer)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("NINFER_API_KEY"),
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY); default: $NINFER_API_KEY, else none",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: the GPU when there is one)")
    p.add_argument("--max-concurrency", type=int, help="sequences decoded together (engine default 8)")
    p.add_argument("--max-context", type=int, help="tokens per sequence, prompt plus output (engine default 8192)")
    p.add_argument("--max-pending", type=int, help="queued requests before answering 429 (engine default 256)")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step (engine default 512)")
    p.add_argument(
        "--kv-capacity",
        default="auto",
        help="tokens of KV cache all requests share: auto (every slot can hold --max-context) or a number",
    )


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from ninfer.server import ServerConfig, serve

    if args.kv_capacity != "auto" and not (args.kv_capacity.isdigit() and int(args.kv_capacity) > 0):
        raise CliError(f"--kv-capacity must be auto or a positive number of tokens, got {args.kv_capacity!r}")
    for flag in ("max_concurrency", "max_context", "max_pending", "prefill_chunk"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    config = ServerConfig(
        model=args.model,
        model_id=args.model_id,
        api_key=args.api_key or None,
        device=args.device,
        max_concurrency=args.max_concurrency,
        max_context=args.max_context,
        max_pending=args.max_pending,
        prefill_chunk=args.prefill_chunk,
        kv_capacity=None if args.kv_capacity == "auto" else int(args.kv_capacity),
    )
    if not config.model_path().exists():
        raise CliError(f"no such artifact: {config.model_path()}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(config, args.host, args.port))


COMMANDS: dict[str, Command] = {
    "convert": Command("convert a Hugging Face checkpoint into a .ninfer artifact", _configure_convert, _run_convert),
    "inspect": Command("describe a .ninfer artifact (and verify its checksums)", _configure_inspect, _run_inspect),
    "serve": Command("serve a model over the OpenAI and Anthropic APIs", _configure_serve, _run_serve),
    "generate": Command("complete a prompt, streaming the text", _configure_generate, _run_generate),
    "chat": Command("chat with a model in the terminal (multi-turn, streaming)", _configure_chat, _run_chat),
    "perplexity": Command("windowed perplexity of a text file", _configure_perplexity, _run_perplexity),
    "synth": Command("write a synthetic artifact: real shapes and encodings, random values", _configure_synth, _run_synth),
    "bench": Command("measure prefill and decode speed through the engine", _configure_bench, _run_bench),
    "doctor": Command("check Python, the build, the driver and GPUs, and whether a model fits", _configure_doctor, _run_doctor),
}


def build_parser() -> argparse.ArgumentParser:
    from ninfer import __version__

    parser = argparse.ArgumentParser(prog="ninfer", description="Fast inference for Qwen3.5/3.6 hybrid MoE models.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.configure(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`ninfer = "ninfer.cli:main"`); returns the exit status."""
    from ninfer.convert import ConvertError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
