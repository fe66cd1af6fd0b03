"""`python -m builder <command>`: the command line of docs/contract.md.

Every failure a user can cause (bad arguments, missing or corrupt files, a prompt that cannot be
decoded) ends as one line on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from .contract import (ALL_PRECISIONS, DEFAULT_K, DEFAULT_LOOKUP, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE, DRAFT_CUT,
                       DRAFTER_K_MAX, MODES, PEERS, PRECISIONS, RUNTIMES, STOP_REASONS, exported_for)
from .data.tasks import ALL_TASKS, TASKS
from .errors import PromptError, UserError

EXIT_USAGE, EXIT_ERROR = 2, 1


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def draft_cut(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 (no cut) up to 1, got {text!r}")
    return value


def task_counts(text: str) -> dict[str, int]:
    """"summarize=4000,proofread=700" -> {"summarize": 4000, "proofread": 700}."""
    out = {}
    for part in text.split(","):
        task, _, n = part.partition("=")
        if task.strip() not in ALL_TASKS or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"want TASK=N,.. with TASK one of {', '.join(ALL_TASKS)}, got {part!r}")
        out[task.strip()] = int(n)
    return out


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a whole number between 0 and 65535, got {text!r}")
    return int(text)


def build_parser() -> Parser:
    p = Parser(prog="python -m builder", description="Frozen MTP in the browser: tooling.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="greedy decoding from Python")
    g.add_argument("--base", default="models/base", help="base checkpoint directory")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user's text")
    src.add_argument("--prompts-file", type=Path, help='JSON lines: {"prompt": "...", "task": "..."}')
    g.add_argument("--task", default="continue", choices=list(ALL_TASKS))
    g.add_argument("--head", default="models/mtp", help="MTP head directory (mode mtp)")
    g.add_argument("--drafter", default="models/drafter", help="independent drafter directory (mode drafter)")
    g.add_argument("--mode", default=DEFAULT_MODE, choices=list(MODES),
                   help="ar: plain greedy decoding with the base alone (the reference); mtp: the MTP head drafts, the "
                        "base verifies; drafter: the independent drafter drafts, the base verifies. The same ids in "
                        f"every mode (default {DEFAULT_MODE}, as the page's)")
    g.add_argument("--k", type=int, default=DEFAULT_K,
                   help="tokens drafted per step (speculative modes): mtp at most the head's trained chain length "
                        f"(its config's k_train), drafter at most {DRAFTER_K_MAX}")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=DEFAULT_LOOKUP,
                   help="speculative modes: prompt lookup first - where the text's last three tokens occurred before, "
                        "draft the tokens that followed them there (no model runs), elsewhere the mode's source "
                        f"(default {'on' if DEFAULT_LOOKUP else 'off'}, as the page's)")
    g.add_argument("--draft-cut", type=draft_cut, default=0.0,
                   help="speculative modes: verify only the drafts before the running product of the head's "
                        "probabilities for them falls below this (0, the default: all; the page cuts on WASM, where "
                        f"verifying more tokens costs more: {DRAFT_CUT['wasm']})")
    g.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="stop after this many new tokens; decoding also stops at the end-of-sequence token and "
                        "when the prompt and its new tokens fill the context window (JSON field `stopped`)")
    g.add_argument("--backend", default="torch", choices=["torch", "onnx"],
                   help="torch: the PyTorch modules; onnx: the exported ONNX graphs with onnxruntime on the CPU")
    g.add_argument("--precision", default="fp32", choices=ALL_PRECISIONS,
                   help="--backend onnx: the fp32 graphs or their fp16 variants (what the page runs on WebGPU "
                        "with shader-f16), or q4 (a base imported from a GGUF, exported with fp32: its graph "
                        "on the file's 4- and 8-bit blocks, what the page runs on WebGPU; slow on the CPU); the exactness rule "
                        "compares within one precision")
    g.add_argument("--onnx-dir", default="build/onnx",
                   help="the ONNX export that --backend onnx runs (graphs, weights files, manifest.json); "
                        "exported there from --base (and --head or --drafter) when it is missing or was "
                        "exported from other checkpoints. Every file is checked against the manifest's sha256.")
    g.add_argument("--adapter", help="a feature's adapter directory (models/adapters/TASK): decode with the "
                                     "feature's production model, the frozen base plus this adapter")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")

    t = sub.add_parser("train-base", help="reproduce models/inhouse/base (tokenizer and model), the in-house 10 M base "
                                          "trained from Debian's documentation (the fast test model)")
    t.add_argument("--base", default="models/inhouse/base", help="where the trained base is written")
    t.add_argument("--run-dir", default="build/train-base",
                   help="the run's tokenized data and checkpoint: the same command resumes there")
    t.add_argument("--steps", type=positive_int, help="optimizer steps (default: as many as --minutes allow)")
    t.add_argument("--minutes", type=float, help="training budget in minutes when --steps is not given (default 150)")
    t.add_argument("--batch-size", type=positive_int, help="sequences per step (default 8)")
    t.add_argument("--checkpoint-minutes", type=float, help="minutes between checkpoints (default 5)")
    t.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when PyTorch sees one")
    t.add_argument("--threads", type=positive_int, help="CPU threads (default: PyTorch's, one per core)")
    t.add_argument("--sources", help="comma-separated corpus packages (default: all of builder/data/corpus.py's SOURCES)")
    t.add_argument("--restart", action="store_true", help="discard the run saved in --run-dir and start over")
    t.add_argument("--against", help="another base measured on the same validation text, for the model card "
                                     "(default: models/inhouse/base, when --base writes elsewhere)")
    t.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("build", help="export the models to ONNX and render the static site")
    b.add_argument("--base", default="models/base", help="base checkpoint directory")
    b.add_argument("--head", default="models/mtp", help="MTP head directory")
    b.add_argument("--drafter", help="independent drafter directory, or 'none' (default: models/drafter when it was "
                                     "distilled from this base, by fingerprint; else none: the page then offers ar and mtp)")
    b.add_argument("--adapters", help="the features' adapter directories, comma-separated, or 'none' (default: those "
                                      "under models/adapters trained on this base, by fingerprint)")
    b.add_argument("--out", default="build/site", help="where the site is written: a new or empty folder, or a site "
                                                       "build made (replaced); any other folder is refused")
    b.add_argument("--onnx-dir", default="build/onnx",
                   help="the ONNX export the site copies; exported there first when missing or stale")
    b.add_argument("--precision", choices=["fp32", "fp16", "both"],
                   help="which graphs the site ships: fp32 (every browser), fp16 (half the download; WebGPU "
                        "with shader-f16 computes in fp16, WASM casts to fp32), or both (the page picks). Default: "
                        "fp32 for a base imported from a GGUF (the page downloads its 4-bit blocks and rebuilds the "
                        "fp32 weights; an fp16 copy would be a 270 MB download), else both")

    s = sub.add_parser("serve", help="serve a built site on 127.0.0.1")
    s.add_argument("--dir", default="build/site", help="the built site")
    s.add_argument("--port", type=port, default=8000, help="0 picks a free port")

    h = sub.add_parser("train-head", help="reproduce models/mtp: the MTP head, trained on the frozen base")
    h.add_argument("--base", default="models/base", help="the frozen base checkpoint")
    h.add_argument("--head", default="models/mtp", help="where the trained head is written")
    h.add_argument("--steps", type=positive_int, help="optimizer steps (default: the shipped head's)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--data", type=Path, help="your own training text: a UTF-8 file, or a directory of .txt/.md/.rst "
                                             "files (paragraphs between blank lines; 1 in 20 held back for the tau "
                                             "report). Default: the built-in corpus (eight Debian documentation packages: corpus.HEAD_SOURCES)")
    h.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available, else cpu")
    h.add_argument("--prompts-per-task", type=positive_int, help="self-distillation prompts per task (default 2000)")
    h.add_argument("--batch-size", type=positive_int, help="sequences per step (default 16)")
    h.add_argument("--eval-prompts", type=positive_int, help="held-back prompts per task for the tau report (default 60)")
    h.add_argument("--checkpoint-every", type=positive_int,
                   help="steps between checkpoints in HEAD/checkpoint/ (default 100; also saved on Ctrl-C). "
                        "A run with the same settings, base and data resumes from it")
    h.add_argument("--targets", choices=["greedy", "distribution"],
                   help="what each draft learns: the base's whole next-token distribution (default) or its greedy token")
    h.add_argument("--kv-layer", type=int, help="the base layer whose KV cache the head reads (default: the layer "
                                                "with the strongest induction head, measured on the base)")
    h.add_argument("--restart", action="store_true", help="discard a checkpoint in HEAD/checkpoint/ and start over")
    h.add_argument("--lr", type=float, help="peak learning rate (default 0.0015)")
    h.add_argument("--draft-vocab", type=positive_int, help="a reduced draft vocabulary: the base's N most used "
                                                            "tokens in the distilled data (default: its whole vocabulary); "
                                                            "with --init, the N of its head's tokens used most")
    h.add_argument("--cache-features", action="store_true", help="keep the base's hidden states and read layer's "
                                                                 "keys/values from its distillation (build/distill/), not "
                                                                 "run it at every step (a big base)")
    h.add_argument("--task-prompts", type=task_counts, help="prompts per task where they differ from "
                                                            "--prompts-per-task, e.g. summarize=4000,proofread=700")
    h.add_argument("--chat-messages", type=positive_int, help="N more reply prompts that are real short messages (the "
                   "chatterbot-corpus package's, data/messages.py; its held-back ones get their own tau table)")
    h.add_argument("--everyday", type=task_counts, help="train on the production models' answers: N of each feature's "
                   "everyday training texts (data/everyday.py), decoded by the base plus the feature's adapter in "
                   "--adapters (continue: the base), e.g. proofread=800,summarize=600,reply=800,continue=400; "
                   "needs --cache-features")
    h.add_argument("--adapters", help="with --everyday: the features' adapters, ADAPTERS/TASK (default models/adapters)")
    h.add_argument("--layers", type=positive_int, help="the head's decoder layers (default 1); with --init, more than the "
                   "head has adds layers that start as the identity (a deeper second stage)")
    h.add_argument("--replay", action="store_true", help="with --init: train on every earlier stage's data as well as "
                                                          "this stage's prompts (a stage on one task that keeps the others)")
    h.add_argument("--init", help="a head trained for this base to go on training (a second stage on more data, "
                                  "e.g. another --seed); it keeps its architecture (but --layers may add layers) and base layer")
    r = sub.add_parser("bench", help="plain vs MTP vs drafter: speed, acceptance and memory, in Python and the browser")
    r.add_argument("--base", default="models/base", help="base checkpoint directory")
    r.add_argument("--head", default="models/mtp", help="MTP head directory")
    r.add_argument("--drafter", default="models/drafter", help="independent drafter directory")
    r.add_argument("--json", default="build/bench/bench.json", type=Path,
                   help="where the results go; the report (bench.md and PNG plots) is written next to it")
    r.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated, from " + ", ".join(RUNTIMES))
    r.add_argument("--peers", help="comma-separated, from " + ", ".join(PEERS) + ", or none: the same model in other "
                                   "runtimes, plain decoding (default: all of them for a base imported from a GGUF, "
                                   "whose file they run; else none)")
    r.add_argument("--text", choices=["everyday", "corpus"], help="the prompts: each feature's held-out everyday texts "
                   "(default for a chat base) or the corpus's validation prompts (default otherwise)")
    r.add_argument("--adapters", help="the features' adapter directories, comma-separated, or 'none': each feature "
                   "decoded by its production model (default: those in models/adapters trained on this base)")
    r.add_argument("--prompts", type=positive_int, help="prompts per task (every runtime)")
    r.add_argument("--new-tokens", type=positive_int, help="new tokens per prompt (every runtime)")
    r.add_argument("--ks", help="comma-separated k of the speculative modes (every runtime)")
    r.add_argument("--repeats", type=positive_int, help="measured rounds (every runtime)")
    r.add_argument("--onnx-dir", default="build/onnx", help="the ONNX export (made when missing or stale)")
    r.add_argument("--site-dir", default="build/site", help="the site the browser runtimes load (rebuilt)")

    a = sub.add_parser("train-adapter", help="train a feature's adapter (LoRA) on the frozen base: models/adapters/TASK")
    a.add_argument("--task", required=True, choices=["proofread", "reply", "summarize"], help="the feature")
    a.add_argument("--base", default="models/base", help="base checkpoint directory (frozen)")
    a.add_argument("--out", help="where the adapter goes (default models/adapters/TASK)")
    a.add_argument("--run-dir", help="the resumable run's checkpoint (default runs/adapter-TASK)")
    a.add_argument("--steps", type=positive_int, help="optimizer steps (default 600)")
    a.add_argument("--minutes", type=float, help="train for this many minutes instead of --steps")
    a.add_argument("--examples", type=positive_int, help="training pairs (default 8000)")
    a.add_argument("--eval-examples", type=positive_int, help="held-out pairs the card measures (default 200)")
    a.add_argument("--batch-size", type=positive_int)
    a.add_argument("--lr", type=float)
    a.add_argument("--rank", type=positive_int, help="the adapter's rank (default 8)")
    a.add_argument("--threads", type=positive_int, help="PyTorch CPU threads (default: all cores)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--restart", action="store_true", help="discard the run's checkpoint and start over")

    d = sub.add_parser("train-drafter", help="reproduce models/drafter: the independent drafter baseline")
    d.add_argument("--base", default="models/base", help="the base whose greedy outputs the drafter learns")
    d.add_argument("--drafter", default="models/drafter", help="where the trained drafter is written")
    d.add_argument("--steps", type=positive_int, help="optimizer steps (default: the shipped drafter's)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eval-prompts", type=positive_int, help="validation prompts per task for the tau report (default 60)")
    d.add_argument("--head", help="a head trained with --cache-features: learn from every stage of its data (the base's "
                                  "cached hidden states) and over its draft vocabulary (a big base)")
    d.add_argument("--hidden-size", type=positive_int, help="width (default 128)")
    d.add_argument("--layers", type=positive_int, help="decoder layers (default 2)")
    d.add_argument("--intermediate-size", type=positive_int, help="MLP width (default 320)")
    d.add_argument("--batch-size", type=positive_int, help="sequences per step (default 16)")
    d.add_argument("--lr", type=float, help="peak learning rate (default 0.003)")
    return p


STOP_NOTES = dict(zip(STOP_REASONS, ("stopped at --max-new-tokens", "the model ended the text",
                                      "stopped: the prompt and the new tokens fill the context window of {context} tokens")))


def read_prompts(args) -> list[dict]:
    """The prompts to decode; lone surrogates (undecodable argv bytes, broken JSON escapes) become U+FFFD."""
    from .data.tasks import well_formed

    if args.prompt is not None:
        return [{"prompt": well_formed(args.prompt), "task": args.task}]
    path: Path = args.prompts_file
    if not path.is_file():
        raise PromptError(f"prompts file not found: {path}")
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise PromptError(f"{path}:{line}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}): "
                          "save the file as UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise PromptError(f'{path}:{n}: expected an object with a string "prompt"')
        prompts.append({"prompt": well_formed(obj["prompt"]), "task": obj.get("task", args.task)})
    if not prompts:
        raise PromptError(f"{path} holds no prompts")
    return prompts


def cmd_generate(args) -> None:
    from .data.tasks import decode as decode_text, encode_prompt, load_tokenizer
    from .decode.drafter import load_drafter, torch_drafter
    from .decode.loop import decode, room
    from .decode.onnx_backend import OnnxBackend
    from .decode.torch_backend import TorchBackend
    from .export.manifest import Checkpoints, ensure_export
    from .models.head import load_head
    from .models.llama import load_llama

    base_dir = Path(args.base)
    if args.precision != "fp32" and args.backend != "onnx":
        raise PromptError(f"--precision {args.precision} needs --backend onnx (the torch backend runs fp32)")
    model = load_llama(base_dir)
    adapter = None  # the feature whose production model decodes (base + its adapter)
    if args.adapter:
        from .models.adapter import load_adapter
        from .models.head import base_fingerprint

        adapter = load_adapter(model, args.adapter, base_fingerprint(model)).get("task")
    eos = model.config.eos_token_id
    source = MODES[args.mode]
    head = load_head(args.head, model) if source == "head" else None
    drafter = load_drafter(args.drafter, model) if source == "drafter" else None
    k_max = head.config.k_train if head else DRAFTER_K_MAX
    if source and not 1 <= args.k <= k_max:
        why = f"the head was trained to draft {k_max}" if head else "the drafter's limit"
        raise PromptError(f"--k must be between 1 and {k_max} in mode {args.mode} ({why}), got {args.k}")
    if args.backend == "onnx":
        ckpts = Checkpoints(base_dir, Path(args.head) if head else None, Path(args.drafter) if drafter else None,
                            (Path(args.adapter),) if args.adapter else ())
        ensure_export(ckpts, Path(args.onnx_dir), exported_for(args.precision))
        backend = OnnxBackend(args.onnx_dir, source, args.k if source else 0, args.precision, adapter=adapter)
    else:
        backend = TorchBackend(model, head=head, drafter=torch_drafter(drafter) if drafter else None)
    tok = load_tokenizer(base_dir)
    k = args.k if source else 0
    jobs = []
    for n, p in enumerate(read_prompts(args), 1):  # check every prompt before decoding any
        where = f"prompt {n}: " if args.prompts_file else ""
        try:
            ids = encode_prompt(tok, p["task"], p["prompt"])
            room(ids, args.max_new_tokens, backend.context)
        except PromptError as e:
            raise PromptError(where + str(e)) from None
        jobs.append((p, ids))
    for p, prompt_ids in jobs:
        t0 = time.perf_counter()
        out = decode(backend, prompt_ids, args.max_new_tokens, eos, k, lookup=args.lookup, draft_cut=args.draft_cut)
        seconds = time.perf_counter() - t0
        text = decode_text(tok, out.ids)
        if args.json:
            # margins: the base's own top-1 minus top-2 logit at each new token, from the pass that decided it
            print(json.dumps({"prompt": p["prompt"], "task": p["task"], "mode": args.mode, "k": args.k,
                              "lookup": bool(source) and args.lookup, "lookups": out.lookups,
                              "draft_cut": args.draft_cut if source == "head" else 0.0,
                              "verified": out.verified,
                              "backend": args.backend, "precision": args.precision, "adapter": args.adapter,
                              "prompt_ids": prompt_ids,
                              "ids": out.ids, "text": text,
                              "steps": out.steps, "accepted": out.accepted, "stopped": out.stopped,
                              "margins": out.margins, "seconds": round(seconds, 4)}, ensure_ascii=False), flush=True)
        else:
            print(text, flush=True)
            sys.stderr.write(f"[{STOP_NOTES[out.stopped].format(context=backend.context)}]\n")


def chosen_adapters(args) -> tuple[Path, ...]:
    """--adapters DIR,DIR or none; default: those in models/adapters trained on this base."""
    from .models.adapter import adapters_for

    if args.adapters is None:
        return adapters_for(Path(args.base), Path("models/adapters"))
    return () if args.adapters == "none" else tuple(Path(d) for d in args.adapters.split(",") if d)


def cmd_build(args) -> None:
    from .decode.drafter import drafter_for
    from .export.manifest import Checkpoints
    from .site.build import build

    if args.drafter is None:
        drafter = drafter_for(Path(args.base), Path("models/drafter"))
    else:
        drafter = None if args.drafter == "none" else Path(args.drafter)
    ckpts = Checkpoints(Path(args.base), Path(args.head), drafter, chosen_adapters(args))
    from .models.gguf import SOURCE

    precision = args.precision or ("fp32" if (Path(args.base) / SOURCE).is_file() else "both")
    precisions = tuple(PRECISIONS) if precision == "both" else (precision,)
    build(ckpts, Path(args.out), Path(args.onnx_dir), precisions)
    print(f"built {args.out}: serve it with `python -m builder serve --dir {args.out}`")


def cmd_serve(args) -> None:
    from .site.serve import serve

    serve(Path(args.dir), args.port)


def cmd_train_base(args) -> None:
    import torch

    from .train.base import TrainConfig, train_and_report

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PromptError("--device cuda: no CUDA device is available to PyTorch here")
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"steps": args.steps, "minutes": args.minutes, "batch_size": args.batch_size,
               "checkpoint_minutes": args.checkpoint_minutes,
               "sources": tuple(args.sources.split(",")) if args.sources else None}
    cfg = TrainConfig(seed=args.seed, **{k: v for k, v in options.items() if v is not None})
    run_dir = Path(args.run_dir)
    if args.restart:
        shutil.rmtree(run_dir, ignore_errors=True)
    against = Path(args.against or "models/inhouse/base")
    if against.resolve() == Path(args.base).resolve() or not (against / "config.json").is_file():
        if args.against:
            raise PromptError(f"--against {args.against}: not another base checkpoint directory")
        against = None
    log = train_and_report(Path(args.base), cfg, run_dir, device=args.device, against=against)
    v = log["validation"]
    print(f"wrote {args.base}: {v['bits_per_byte']:.3f} bits per byte on validation text, proofread exact-fix "
          f"{v['proofread_exact_fix']:.1%}, summarize word overlap {v['summarize_overlap_f1']:.3f}")


def cmd_train_head(args) -> None:
    import torch

    from .train.head import HeadTrainConfig, train_and_report

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PromptError("--device cuda: no CUDA device is available to PyTorch here")
    options = {"steps": args.steps, "prompts_per_task": args.prompts_per_task, "batch_size": args.batch_size,
               "eval_prompts": args.eval_prompts, "checkpoint_every": args.checkpoint_every, "targets": args.targets,
               "kv_layer": args.kv_layer, "lr": args.lr, "task_prompts": args.task_prompts, "init": args.init,
               "layers": args.layers, "draft_vocab": args.draft_vocab, "cache_features": args.cache_features or None,
               "replay": args.replay or None, "chat_messages": args.chat_messages, "everyday": args.everyday,
               "adapters": args.adapters}
    cfg = HeadTrainConfig(seed=args.seed, **{k: v for k, v in options.items() if v is not None})
    log = train_and_report(Path(args.base), Path(args.head), cfg, data=args.data, device=args.device,
                           restart=args.restart)
    if "acceptance" not in log:
        return  # a torchrun process other than rank 0: rank 0 reports
    print(f"wrote {args.head} ({log['train_seconds']} s of training on {log['device']}, "
          f"{log['trained_tokens'] / 1e6:.3g} M tokens); tau on held-back text:")
    for row in log["acceptance"].values():
        print(f"  {row['task']:9} k={row['k']}  tau {row['tau']:.2f}  acceptance by position "
              + " ".join(f"{a:.2f}" for a in row["accept_by_position"]))


def cmd_bench(args) -> None:
    from .bench.report import summary_table, write_report
    from .bench.run import BenchConfig, bench
    from .export.manifest import Checkpoints
    from .models.head import read_head_config

    runtimes = tuple(x.strip() for x in args.runtimes.split(",") if x.strip())
    unknown = [x for x in runtimes if x not in RUNTIMES]
    if unknown or not runtimes:
        raise PromptError(f"unknown runtime {unknown[0] if unknown else '(none)'}: choose from {', '.join(RUNTIMES)}")
    ks = None
    if args.ks:
        try:
            ks = tuple(int(x) for x in args.ks.split(","))
        except ValueError:
            raise PromptError(f"--ks must be comma-separated whole numbers, got {args.ks!r}") from None
        k_max = read_head_config(args.head).k_train
        if not all(1 <= k <= k_max for k in ks):
            raise PromptError(f"--ks must lie between 1 and {k_max} (the head drafts at most {k_max}), got {args.ks}")
    from .models.gguf import SOURCE

    gguf_base = (Path(args.base) / SOURCE).is_file()
    if args.peers is None:
        peers = tuple(PEERS) if gguf_base else ()
    else:
        peers = tuple(x.strip() for x in args.peers.split(",") if x.strip() and x.strip() != "none")
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        raise PromptError(f"unknown peer {unknown[0]}: choose from {', '.join(PEERS)}, or none")
    if peers and not gguf_base:
        raise PromptError(f"--peers: the peers run the GGUF file a base was imported from; {args.base} has no {SOURCE}")
    cfg = BenchConfig(runtimes=runtimes, peers=peers, text=args.text)
    override = {name: v for name, v in (("prompts", args.prompts), ("new_tokens", args.new_tokens), ("ks", ks),
                                        ("repeats", args.repeats)) if v is not None}
    cfg.plans = {rt: replace(plan, **override) for rt, plan in cfg.plans.items()}
    ckpts = Checkpoints(Path(args.base), Path(args.head), Path(args.drafter), chosen_adapters(args))
    data = bench(cfg, ckpts, Path(args.onnx_dir), Path(args.site_dir))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    md = write_report(data, args.json)
    print(summary_table(data))
    print(f"wrote {args.json} and {md}")


def cmd_train_drafter(args) -> None:
    from .train.drafter import DrafterTrainConfig, train_and_report

    given = {"steps": args.steps, "eval_prompts": args.eval_prompts, "head": args.head, "hidden_size": args.hidden_size,
             "layers": args.layers, "intermediate_size": args.intermediate_size, "batch_size": args.batch_size, "lr": args.lr}
    cfg = DrafterTrainConfig(seed=args.seed, **{k: v for k, v in given.items() if v})
    log = train_and_report(Path(args.base), Path(args.drafter), cfg)
    k4 = {v["task"]: v["tau"] for v in log["acceptance"].values() if v["k"] == 4}
    print(f"wrote {args.drafter}: tau at k=4 " + ", ".join(f"{t} {v:.2f}" for t, v in k4.items()))


def cmd_train_adapter(args) -> None:
    import torch

    from .train.adapter import AdapterTrainConfig, train_adapter

    if args.threads:
        torch.set_num_threads(args.threads)
    given = {"steps": args.steps, "examples": args.examples, "eval_examples": args.eval_examples,
             "batch_size": args.batch_size, "lr": args.lr, "rank": args.rank}
    cfg = AdapterTrainConfig(task=args.task, seed=args.seed, **{k: v for k, v in given.items() if v is not None})
    out = Path(args.out or f"models/adapters/{args.task}")
    log = train_adapter(Path(args.base), out, Path(args.run_dir or f"runs/adapter-{args.task}"), cfg,
                        minutes=args.minutes, restart=args.restart)
    shares = lambda q: ", ".join(f"{k} {v:.0%}" for k, v in q["shares"].items())  # noqa: E731
    print(f"wrote {out} ({log['train_minutes']} min, {log['steps']} steps): held out, base {shares(log['base'])}; "
          f"with the adapter {shares(log['adapter'])}")


COMMANDS = {"generate": cmd_generate, "build": cmd_build, "serve": cmd_serve, "train-base": cmd_train_base, "train-head": cmd_train_head,
            "train-drafter": cmd_train_drafter, "train-adapter": cmd_train_adapter, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # what the commands report as they go: one plain line each on stderr (stdout is the command's output)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("builder").addHandler(handler)
    logging.getLogger("builder").setLevel(logging.INFO)
    if args.command.startswith("train-"):  # a kill or a closing session saves the run as Ctrl-C does

        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        COMMANDS[args.command](args)
        sys.stdout.flush()  # here, not at exit: a reader that went away (`| head`) is caught below
    except BrokenPipeError:  # the output's reader closed it: nothing more to say, and no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_ERROR
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # the disk is full: writing stdout (print raises it), a checkpoint, an export, the site
        where = e.filename or "the output"
        sys.stderr.write(f"error: no space left on the device writing {where}: free some space and run the command again\n")
        if where == "the output":  # stdout keeps its unwritten bytes: flushing them at exit fails again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    return 0
