"""The `medusa` command: one table of subcommands, each a typed function over parsed arguments."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .decoding import TREE_HELP, Decoding
from .settings import from_arguments, setting
from .train.trainer import TrainConfig

DEMO_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Give me three tips for a productive morning.",
]


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}


@dataclass
class Loading:
    """Which model to load, and how: the options of every command that loads one."""

    base: str | None = setting(None, "hub id, HF folder or GGUF file (default: the embedded SmolLM2-135M-Instruct; "
                               "export: the base recorded with --heads)")
    heads: str | None = setting(None, "heads or EAGLE-style draft folder (default: the heads shipped for the default "
                                "model; train: fresh heads, or these trained further)")
    dtype: str = setting("auto", "float32 (fp32: exact), bfloat16 (bf16: faster where the hardware has it), float16 "
                         "or auto (the model's own)", ("auto", *DTYPES))
    device: str | None = setting(None, "cpu, cuda, cuda:1 ... (default: cuda if available)")
    compile: bool = setting(False, "decoding passes through torch.compile: faster steps after a compile (a minute+ "
                            "at first); for commands that decode")


def load_model(args: argparse.Namespace, **kwargs):
    import torch

    from .model import MedusaModel

    loading = from_arguments(Loading, args)
    device = loading.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hf = {} if loading.dtype == "auto" else {"dtype": getattr(torch, DTYPES[loading.dtype])}
    kwargs.setdefault("projection", "shared")  # fresh heads only: an own copy of lm_head would change nothing
    model = MedusaModel.from_pretrained(loading.base, heads=loading.heads, **hf, **kwargs).to(device)
    if loading.compile:
        print("--compile: the first decoding passes compile (a minute per graph on a small CPU, ~15 s once cached)",
              file=sys.stderr)
        model.compile_decoding()
    return model


def report_tuning(model, refresh: bool = False) -> None:
    """Probe this machine now (or read the cached probe) and say what was chosen, on stderr."""
    from .tuning import ROUTE_ROUNDS, tuning

    tuned = tuning(model, refresh)
    print(tuned.summary() if tuned else "tuning off (MEDUSA_HEADS_TUNE=0): shipped tree, unprobed kernel routes",
          file=sys.stderr, flush=True)
    if tuned and refresh:
        print(f"all linear layers, ms (median of {ROUTE_ROUNDS} rounds):\n{tuned.routes.table()}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    from .tree import Tree

    decoding = from_arguments(Decoding, args)  # bad settings fail before the model loads
    if decoding.tree != "auto":
        Tree.load(decoding.tree)
    model = load_model(args)
    report_tuning(model)  # (decoding probes a new machine whatever the tree: the kernel routes)
    if args.raw:
        ids = model.require_tokenizer()(args.prompt, return_tensors="pt")["input_ids"].to(model.device)
    else:
        ids = model.chat_ids(args.prompt)
    if not args.json:
        for piece in model.stream(ids, **vars(decoding)):
            print(piece, end="", flush=True)
        print()
        return
    out = model.generate(ids, **vars(decoding))
    new = len(out.new_tokens[0])
    print(json.dumps({
        "text": out.texts[0],
        "new_tokens": new,
        "steps": out.steps,
        "mean_accepted_length": round(out.mean_accepted_length, 3),
        "tokens_per_second": round(new / out.elapsed, 2),
    }))


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    model = load_model(args)
    report_tuning(model)
    run_demo(model, DEMO_PROMPTS, args.max_new_tokens)


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench import Method, bench, load_questions

    if args.suite:
        from .suite import suite_questions
        from .train.distill import record_ids

        if not args.prompts:
            raise ValueError("--suite draws its task types from a prompts file: give --prompts (and --exclude the "
                             "heads' training data)")
        seen = set().union(*(record_ids(path) for path in args.exclude or []))
        questions = suite_questions(args.prompts, args.questions, args.per_category or 2, seen)[: args.limit]
    elif args.questions:
        questions = load_questions(args.questions, args.limit, args.per_category)
    else:
        raise ValueError("give --questions (Spec-Bench JSONL) or --suite with --prompts")
    model = load_model(args)
    report_tuning(model)
    gguf = args.gguf
    if gguf is None and args.llama_cpp and args.base is None:
        from .default import gguf_path

        gguf = gguf_path()  # the embedded default's own file
    methods = [Method(m.strip(), model, args.llama_cpp, gguf) for m in args.methods.split(",") if m.strip()]
    result = bench(model, questions, methods, args.out, args.max_new_tokens, args.repeats, args.max_turns)
    print((Path(args.out) / "report.md").read_text())
    if result["summary"]["mismatches"]:
        print(f"{len(result['summary']['mismatches'])} outputs differ from the reference: see report.md")


def cmd_bench_load(args: argparse.Namespace) -> None:
    from .bench import load_bench, load_markdown, load_questions

    model = load_model(args)
    report_tuning(model)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    result = load_bench(model, load_questions(args.questions, args.limit), sizes, args.max_new_tokens, args.tree)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "load.md").write_text(load_markdown(result))
    print(load_markdown(result))


def setup_bench_load(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", required=True, help="Spec-Bench JSONL; first turns are the requests")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="first Q questions only")
    p.add_argument("--tree", default=Decoding.tree, help=f"the Medusa rows' tree: {TREE_HELP}")
    p.add_argument("--out", required=True, help="folder for load.json and load.md")


def setup_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", help="Spec-Bench JSONL (question_id, category, turns); with --suite: MT-bench")
    p.add_argument("--suite", action="store_true",
                   help="task types the heads never saw, one row each (translation, summarization, passage-qa, math, "
                        "code, from --prompts minus --exclude) plus MT-bench (--questions); --per-category each")
    p.add_argument("--prompts", help="--suite: prompts JSONL with categories (../shared/data/train_prompts.jsonl)")
    p.add_argument("--exclude", action="append", help="--suite: JSONL whose records' ids are skipped (training data)")
    p.add_argument("--methods", default="hf,hf-pld,plain,medusa",
                   help="comma-separated: hf, hf-pld, plain, medusa (tree auto), medusa:TREE, medusa-adapt[:TREE], "
                        "llama.cpp:gguf, "
                        "llama.cpp:F32, llama.cpp:BF16 (default: %(default)s)")
    p.add_argument("--llama-cpp", help="folder of llama.cpp's binaries, for llama.cpp methods "
                   "(../shared/tools/build-llama-cpp prints it)")
    p.add_argument("--gguf", help="GGUF file for llama.cpp methods (default: the embedded default's Q4_1 file)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="first Q questions only")
    p.add_argument("--per-category", type=int, default=None, help="first N questions of each category only")
    p.add_argument("--repeats", type=int, default=1, help="time each answer R times, keep the median")
    p.add_argument("--max-turns", type=int, default=None, help="answer only the first N turns of each question")
    p.add_argument("--out", required=True, help="folder for results.json, report.md and the plots")


def cmd_distill(args: argparse.Namespace) -> None:
    from .train.distill import EndpointAnswerer, LocalAnswerer, distill, read_prompts

    prompts = read_prompts(args.prompts)
    if args.sample:  # a seeded random subset, in random order: the same on every rerun
        import random

        prompts = random.Random(args.seed).sample(prompts, min(args.sample, len(prompts)))
    prompts = prompts[: args.limit]
    if args.endpoint:
        answerer = EndpointAnswerer(args.endpoint, args.model, args.max_new_tokens, args.temperature, args.batch_size)
    else:
        answerer = LocalAnswerer(load_model(args), args.max_new_tokens, args.temperature, args.seed, args.batch_size)
    added = distill(prompts, answerer, args.out, answers=args.answers)
    print(f"{args.out}: {added} prompts answered, {len(prompts)} in all")


def setup_distill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help='JSONL of {"turns": [...]} or ShareGPT (assistant turns redone)')
    p.add_argument("--out", required=True, help="ShareGPT JSONL to write (resumes if it exists)")
    p.add_argument("--answers", help="gzip JSONL of the answers alone (no prompts), kept in step with --out: "
                   "commit or carry it; a rerun rebuilds --out from it and --prompts")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: exact sampling")
    p.add_argument("--batch-size", type=int, default=16,
                   help="answers decoded together, continuously refilled (or parallel requests)")
    p.add_argument("--endpoint", help="OpenAI-compatible base URL (e.g. http://host:8000/v1) instead of local")
    p.add_argument("--model", help="model name at the endpoint (default: the first it lists)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--sample", type=int, default=None, help="a random sample of N prompts (seeded by --seed)")


def cmd_train(args: argparse.Namespace) -> None:
    from .default import default_base_dir
    from .train.trainer import Trainer, prepare_examples

    config = from_arguments(TrainConfig, args)
    if args.base is None:  # named, so that the default base gets fresh heads, not the shipped ones
        args.base = str(default_base_dir())
    model = load_model(args, num_heads=config.num_heads, num_layers=config.num_layers, projection=config.projection,
                       draft_vocab=config.draft_vocab, next_token=config.next_token, chained=config.chained,
                       draft=config.draft)
    train, held_out, skipped = prepare_examples(model, args.data, config)
    if skipped:
        print(f"skipped {skipped} malformed records")
    trainer = Trainer(model, config, args.out)
    trainer.fit(train, held_out, resume=args.resume)
    if trainer.accelerator.is_main_process:
        print(f"heads saved in {args.out}")


def setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="ShareGPT / messages JSON or JSONL")
    p.add_argument("--out", required=True, help="folder for the heads (and checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def cmd_export(args: argparse.Namespace) -> None:
    from .default import DEFAULT_NAME
    from .io import export_heads
    from .model import recorded_base

    if args.base is None and args.heads:  # the base the heads were made for, not the embedded default
        made_for = recorded_base(args.heads)
        if not made_for:
            raise ValueError(f"{args.heads} records no base model: pass --base (the model the heads were trained on)")
        if Path(made_for).name != DEFAULT_NAME:  # the embedded default is found wherever it was converted
            args.base = made_for
    model = load_model(args)
    out = export_heads(model.heads, args.out, args.format, model.base_name)
    print(f"{out}: {args.format} layout written; see {out / 'README.md'} for the serving command")


def setup_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", required=True, choices=["vllm", "tgi", "medusa"])
    p.add_argument("--out", required=True, help="folder to write")


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .serve.app import create_app

    model = load_model(args)
    report_tuning(model)
    app = create_app(model, args.max_concurrency, args.max_queue, args.max_new_tokens_limit, args.tree)
    print(f"serving on http://{args.host}:{args.port}/v1 with tree {app.state.engine.tree}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def setup_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrency", type=int, default=4, help="requests decoded at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; beyond that: 429")
    p.add_argument("--max-new-tokens-limit", type=int, default=2048, help="largest max_tokens accepted")
    p.add_argument("--tree", default=Decoding.tree, help=f"every request's tree: {TREE_HELP}")
    p.add_argument("--log-level", default="warning")


def cmd_chat(args: argparse.Namespace) -> None:
    from .chat import run_chat

    decoding = from_arguments(Decoding, args)  # bad settings fail before the model loads
    model = load_model(args)
    report_tuning(model)
    run_chat(model, decoding)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from .eagle import EagleDraft

    if args.probe:
        report_tuning(load_model(args), refresh=True)
        return
    if not (args.prompts and args.out):
        raise ValueError("give --prompts and --out to calibrate the heads, or --probe to probe this machine again")
    from .calibrate import TOLERANCE, calibrate
    from .train.distill import read_prompts, record_ids

    model = load_model(args)
    seen = set().union(*(record_ids(path) for path in args.exclude or []))  # the heads' training prompts
    kept = [turns for key, turns in read_prompts(args.prompts) if key not in seen][: args.limit]
    if not kept:
        raise ValueError(f"{args.prompts}: no prompt left to calibrate on after --exclude")
    prompts = [model.chat_ids(turns[0]) for turns in kept]
    if isinstance(model.heads, EagleDraft):
        calibrate_dynamic(args, model, prompts)
        return
    result = calibrate(model, prompts, args.max_new_tokens, args.max_nodes,
                       tolerance=TOLERANCE if args.tolerance is None else args.tolerance)
    print(f"head accuracies measured on the greedy answers to {len(prompts)} prompts")
    lookups = "".join(f"{'L=' + str(r['lookup']):>13}" for r in result["table"][0]["replay"])
    print(f"{'':>5} {'expected':>9} {'c(n)':>8} {'':>6} {'expected':>9}   "
          "replayed accepted length / speed-up, lookup branch of L")
    print(f"{'nodes':>5} {'accepted':>9} {'measured':>8} {'fitted':>6} {'speed-up':>9}  {lookups}")
    for row in result["table"]:
        replays = "".join(f"{r['accepted_length']:>6.2f} /{r['speedup']:>5.2f}" for r in row["replay"])
        print(f"{row['nodes']:>5} {row['expected_accepted_length']:>9.3f} {row['measured_cost']:>8.3f} "
              f"{row['cost']:>6.3f} {row['expected_speedup']:>9.3f}  {replays}")
    tree, record = result["tree"], result["record"]
    tree.save(args.out, table=result["table"], accuracy_top_r=record.accuracy_top_r, device=str(model.device))
    print(f"chose {tree.head_size - 1} head nodes (depth {tree.depth}) and a lookup branch of {tree.lookup}; "
          f"tree written to {args.out}")
    record_file = args.record or (Path(args.heads) / record.FILE if args.heads else None)
    if record_file:
        record.save(record_file)
        print(f"replay record written to {record_file}: tree=auto chooses from it on any machine")


def calibrate_dynamic(args: argparse.Namespace, model, prompts) -> None:
    """`medusa calibrate` for an EAGLE-style draft: each dynamic tree's accepted length, and this machine's pick."""
    from .calibrate import TOLERANCE, choose_dynamic, record_dynamic

    record = record_dynamic(model, prompts, args.max_new_tokens)
    result = choose_dynamic(model, record, prompts[0], TOLERANCE if args.tolerance is None else args.tolerance)
    print(f"accepted lengths measured on the greedy answers to {len(prompts)} prompts")
    print(f"{'tree':>16} {'accepted':>9} {'c(n)':>6} {'speed-up':>9}")
    for row in result["table"]:
        print(f"{row['tree']:>16} {row['accepted_length']:>9.3f} {row['cost']:>6.3f} {row['speedup']:>9.3f}")
    result["tree"].save(args.out, table=result["table"], device=str(model.device))
    print(f"chose {result['tree'].name}; written to {args.out}")
    record_file = args.record or (Path(args.heads) / record.FILE if args.heads else None)
    if record_file:
        record.save(record_file)
        print(f"accepted lengths written to {record_file}: tree=auto chooses from them on any machine")


def setup_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe", action="store_true",
                   help="only probe this machine again (kernel routes, cost curve, the auto tree) and cache it")
    p.add_argument("--prompts", help='JSONL of {"turns": [...]} or ShareGPT; first turns are used')
    p.add_argument("--out", help="tree JSON to write")
    p.add_argument("--record", help="where to write the heads' replay record (default: HEADS/replay.json with --heads)")
    p.add_argument("--limit", type=int, default=20, help="prompts to answer for the accuracies (default 20)")
    p.add_argument("--exclude", action="append", help="JSONL whose records' ids are skipped (the training data)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree considered")
    p.add_argument("--tolerance", type=float,
                   help="of the trees whose replayed speed-up is within this fraction of the best, take the one whose "
                        "steps cost least (default 0.03; 0: the fastest)")


def setup_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="print text, new tokens, steps, mean accepted length, tok/s")


def setup_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)


def no_options(p: argparse.ArgumentParser) -> None:
    """A command whose options are all its settings dataclasses'."""


# name: (help, the settings dataclasses its options come from, add its other options, run)
COMMANDS: dict[str, tuple[str, tuple[type, ...], Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], None]]] = {
    "generate": ("answer one prompt (streams the text; --json for stats)", (Loading, Decoding), setup_generate,
                 cmd_generate),
    "bench": ("Spec-Bench-style benchmark of Medusa against the peers", (Loading,), setup_bench, cmd_bench),
    "distill": ("self-distillation: the model answers prompts itself (resumable)", (Loading,), setup_distill,
                cmd_distill),
    "train": ("train heads: Medusa-1 (frozen backbone) or Medusa-2 (LoRA backbone)", (Loading, TrainConfig),
              setup_train, cmd_train),
    "calibrate": ("record head accuracy, measure this device's cost curve, write the best tree (--probe: "
                  "probe this machine again)", (Loading,), setup_calibrate, cmd_calibrate),
    "export": ("write heads for vLLM, TGI or the original Medusa code", (Loading,), setup_export, cmd_export),
    "chat": ("chat in the terminal, streaming, with speed statistics", (Loading, Decoding), no_options, cmd_chat),
    "serve": ("OpenAI-compatible HTTP server (chat, completions, streaming)", (Loading,), setup_serve, cmd_serve),
    "bench-load": ("throughput and latency at batch 1, 2, 4, 8: Medusa vs plain batched", (Loading,),
                   setup_bench_load, cmd_bench_load),
    "demo": ("answer a few prompts with the default model: plain vs Medusa speed", (Loading,), setup_demo, cmd_demo),
}


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it or it has none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == [] or "default" in (
                action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The `medusa` parser: each command's options generated from its settings dataclasses (transformers'
    HfArgumentParser reads their fields' types, defaults, help and choices), then its own."""
    from transformers import HfArgumentParser

    parser = argparse.ArgumentParser(prog="medusa", description="Medusa speculative decoding for Hugging Face LMs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=HfArgumentParser)
    for name, (help, settings, setup, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help, dataclass_types=settings, formatter_class=Help)
        setup(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per quick weight load is noise; ours show real work
    logging.set_verbosity_error()
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"medusa {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
