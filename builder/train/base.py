"""Train the default base: a byte-level BPE tokenizer and a deep, thin Llama on Debian's documentation.

The training stream is a shuffled sequence of examples of the three tasks, each ended by <|endoftext|>:

    <|continue|>{heading}\n{paragraph}\n{paragraph}..<|endoftext|>        a section of a document
    <|proofread|>{sentence with typos}<|fix|>{sentence}<|endoftext|>
    <|summarize|>{passage}<|summary|>{its heading}<|endoftext|>

Loss is taken on every token the model would be asked to write: the text of a continue example, the
corrected sentence of a proofread example, the heading of a summarize example (each with its end
token) - not on what the model only reads. Each step trains on `batch_size` windows of `block_size`
tokens at random places of the stream; the places depend on the seed and the step alone, so a resumed
run sees the same data as an uninterrupted one.

A run lives in a run directory (default build/train-base): the tokenizer and the tokenized stream,
written once, and the checkpoint of the one training loop (loop.py: saved every `checkpoint_minutes`, on
Ctrl-C and on SIGTERM; the same command resumes it to the weights of a run never stopped). The budget is
`steps`, or `minutes` of training. The learning rate warms up, stays, and decays linearly to a tenth over
the last `cooldown` share of the steps (loop.Schedule's "wsd").
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..data.corpus import (PYTHON, SOURCES, Corpus, load_corpus, missing_packages, proofread_pairs, summary_pairs,
                           validation_prompts)
from ..data.tasks import EOS, SPECIAL_TOKENS, TASKS, decode, encode_prompt, encode_text, load_tokenizer
from ..decode.torch_backend import decode_ar
from ..errors import DataError
from ..models.llama import Llama, LlamaConfig, load_config, load_llama, save_llama
from .cards import render_card
from .loop import Run, Schedule, train

logger = logging.getLogger(__name__)

# The shipped base's shape: deep and thin like on-device models (see the model card for the alternatives).
DEEP = dict(num_hidden_layers=24, hidden_size=192, intermediate_size=512, num_attention_heads=6, num_key_value_heads=2)


TOKENIZER_SAMPLE = 100_000  # training paragraphs the tokenizer learns its merges from (about 20 M characters)


@dataclass
class TrainConfig:
    seed: int = 0
    sources: tuple[str, ...] = tuple(SOURCES)  # the corpus: Debian documentation packages (builder/data/corpus.py)
    vocab_size: int = 4096
    block_size: int = 512         # tokens per training sequence (= the context window)
    batch_size: int = 8           # sequences per step
    steps: int = 0                # optimizer steps; 0: as many as `minutes` of training allow
    minutes: float = 150.0        # the training budget when steps is 0 (fixed after timing the first steps)
    lr: float = 1.5e-3            # peak learning rate
    warmup: int = 100
    cooldown: float = 0.2         # the last share of the steps decays the learning rate linearly to lr/10
    weight_decay: float = 0.1
    proofread_share: float = 0.5  # proofread examples per training paragraph
    summarize_share: float = 1.0  # share of the training corpus's summarize pairs in the stream
    checkpoint_minutes: float = 5.0


def data_key(cfg: TrainConfig) -> dict:
    """What the tokenizer and the stream depend on (as JSON reads it back)."""
    keep = ("seed", "sources", "vocab_size", "proofread_share", "summarize_share")
    return json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k in keep}))


def run_key(cfg: TrainConfig, model_cfg: LlamaConfig) -> dict:
    """What a resumed run must share with the saved one (the budget may change)."""
    skip = ("steps", "minutes", "checkpoint_minutes")
    return json.loads(json.dumps({"train": {k: v for k, v in asdict(cfg).items() if k not in skip}, "model": asdict(model_cfg)}))


# --- tokenizer and stream ------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def section_texts(sections) -> list[str]:
    """Continue examples: a section's heading and paragraphs, one per line."""
    return ["\n".join(([heading] if heading else []) + paras) for heading, paras in sections if paras]


def build_stream(tok: Tokenizer, texts: list[str], pairs: dict[str, list[tuple[str, str]]], seed: int):
    """(ids, weights, tokens): the shuffled examples, concatenated; per token 1 where it is a training
    target; and the stream's tokens per task.

    texts: continue examples; pairs: task -> (what the model reads, what it writes) for proofread and summarize.
    """
    sid = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    enc = lambda strings: [e.ids for e in tok.encode_batch(strings, add_special_tokens=False)]  # noqa: E731
    examples = [([sid[TASKS["continue"][0]]], body + [sid[EOS]]) for body in enc(texts)]
    tokens = {"continue": sum(len(p) + len(a) for p, a in examples)}
    for task, task_pairs in pairs.items():
        marker, sep = (sid[t] for t in TASKS[task])
        reads, writes = enc([a for a, _ in task_pairs]), enc([b for _, b in task_pairs])
        examples += [([marker] + r + [sep], w + [sid[EOS]]) for r, w in zip(reads, writes)]
        tokens[task] = sum(len(r) + len(w) + 3 for r, w in zip(reads, writes))
    random.Random(seed).shuffle(examples)
    ids = np.fromiter((i for p, a in examples for i in p + a), dtype=np.int64)
    weights = np.fromiter((w for p, a in examples for w in [0] * len(p) + [1] * len(a)), dtype=np.float32)
    return ids, weights, tokens


def training_pairs(corpus: Corpus, cfg: TrainConfig) -> dict[str, list[tuple[str, str]]]:
    rng = random.Random(cfg.seed)
    proofread = proofread_pairs(corpus.train, cfg.seed)
    summarize = summary_pairs(corpus.train_sections)
    return {"proofread": rng.sample(proofread, min(len(proofread), int(cfg.proofread_share * len(corpus.train)))),
            "summarize": rng.sample(summarize, int(cfg.summarize_share * len(summarize)))}


def prepare_data(run_dir: Path, cfg: TrainConfig, corpus: Corpus | None = None):
    """The run's tokenizer and stream: made once (from the corpus) and kept in run_dir, so a resumed run
    reads them back as they were, whatever has changed on the machine since."""
    key = data_key(cfg)
    meta_path = run_dir / "data.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == key:
        stream = np.load(run_dir / "stream.npz")
        return Tokenizer.from_file(str(run_dir / "tokenizer.json")), stream["ids"].astype(np.int64), stream["weights"], \
            json.loads(meta_path.read_text())["info"]
    t0 = time.time()
    corpus = corpus or load_corpus(cfg.sources)
    logger.info("corpus: %s training paragraphs from %d sources; training the tokenizer", f"{len(corpus.train):,}", len(cfg.sources))
    sample = random.Random(cfg.seed).sample(corpus.train, min(len(corpus.train), TOKENIZER_SAMPLE))
    tok = train_tokenizer(sample, cfg.vocab_size)
    pairs = training_pairs(corpus, cfg)
    texts = section_texts(corpus.train_sections)
    ids, weights, tokens = build_stream(tok, texts, pairs, cfg.seed)
    info = {"stream_tokens": int(len(ids)), "target_tokens": int(weights.sum()), "tokens_per_task": tokens,
            "continue_examples": len(texts), **{f"{t}_pairs": len(p) for t, p in pairs.items()},
            "train_chars": sum(map(len, corpus.train)), "validation_chars": sum(map(len, corpus.validation)),
            "train_paragraphs": len(corpus.train), "validation_paragraphs": len(corpus.validation),
            "train_files": corpus.files[0], "validation_files": corpus.files[1], "sources": corpus.sources,
            "seconds": round(time.time() - t0)}
    run_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(run_dir / "tokenizer.json"))
    np.savez(run_dir / "stream.npz", ids=ids.astype(np.uint16 if cfg.vocab_size <= 65536 else np.int64), weights=weights)
    (run_dir / "validation.json").write_text(json.dumps(corpus.validation_sections, ensure_ascii=False))
    meta_path.write_text(json.dumps({"key": key, "info": info}, indent=2) + "\n")
    logger.info("stream: %.1f M tokens (%d s)", len(ids) / 1e6, info["seconds"])
    return tok, ids, weights, info


def batch_at(ids: np.ndarray, weights: np.ndarray, cfg: TrainConfig, step: int):
    """The step's windows, a function of the seed and the step alone: inputs, targets, target weights (B, T)."""
    starts = np.random.default_rng([cfg.seed, step]).integers(0, len(ids) - cfg.block_size - 1, size=cfg.batch_size)
    idx = starts[:, None] + np.arange(cfg.block_size + 1)[None, :]
    x, w = torch.from_numpy(ids[idx]), torch.from_numpy(weights[idx])
    return x[:, :-1], x[:, 1:], w[:, 1:]


def weighted_loss(model: Llama, x, y, w) -> torch.Tensor:
    logits, _, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    return (loss * w.flatten()).sum() / w.sum().clamp(min=1)


@torch.no_grad()
def stream_loss(model: Llama, ids: np.ndarray, weights: np.ndarray, block: int) -> tuple[float, float]:
    """(total weighted loss in nats, total weight) over consecutive windows covering the whole stream."""
    total, count = 0.0, 0.0
    n = -(-(len(ids) - 1) // block)  # the last window padded with weight 0
    ids, weights = np.pad(ids, (0, n * block + 1 - len(ids))), np.pad(weights, (0, n * block + 1 - len(weights)))
    for i in range(0, n, 16):
        rows = range(i, min(i + 16, n))
        idx = np.array([np.arange(r * block, r * block + block + 1) for r in rows])
        x, w = torch.from_numpy(ids[idx].astype(np.int64)), torch.from_numpy(weights[idx])
        logits, _, _ = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        total += float((loss * w[:, 1:].flatten()).sum())
        count += float(w[:, 1:].sum())
    return total, count


def optimizer(model: Llama, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


# --- training ------------------------------------------------------------------------------------

def train_base(run_dir: Path, cfg: TrainConfig, model_cfg: LlamaConfig | None = None, corpus: Corpus | None = None,
               device: str | None = None, stop_at: int | None = None) -> tuple[Llama, Tokenizer, dict]:
    """Trains (or resumes) the run in run_dir (loop.train); returns the model, its tokenizer and a log.
    stop_at: save and return after that many steps, as an interrupted run would (for tests)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok, ids, weights, info = prepare_data(run_dir, cfg, corpus)
    model_cfg = LlamaConfig(**asdict(model_cfg or LlamaConfig(**DEEP)))
    model_cfg.vocab_size = tok.get_vocab_size()
    model_cfg.max_position_embeddings = cfg.block_size
    model_cfg.eos_token_id = tok.token_to_id(EOS)

    model = Llama(model_cfg)
    model.init_weights(cfg.seed)
    model.to(device)
    opt = optimizer(model, cfg)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step_loss(step: int):
        x, y, w = (t.to(device) for t in batch_at(ids, weights, cfg, step))
        with autocast:
            return weighted_loss(model, x.long(), y.long(), w), {}

    tokens_per_step = cfg.batch_size * cfg.block_size
    state = train(model, opt, step_loss, Schedule(cfg.lr, cfg.warmup, "wsd", cfg.cooldown), Run(run_dir, run_key(cfg, model_cfg)),
                  steps=cfg.steps, minutes=cfg.minutes, every_minutes=cfg.checkpoint_minutes, stop_at=stop_at,
                  desc="train-base", postfix=lambda st: {"tok_s": f"{(st.step - st.resumed_at) * tokens_per_step / max(1e-9, st.train_seconds):.0f}"})
    log = {"train_config": asdict(cfg), "device": str(device), "steps": state.step, "train_seconds": round(state.train_seconds),
           "tokens_seen": state.step * tokens_per_step, "final_train_loss": state.mean_loss(),
           "parameters": model.num_params(), "data": info}
    return model.cpu(), tok, log


# --- evaluation and the model card ---------------------------------------------------------------

def bits_per_byte(model: Llama, tok: Tokenizer, paragraphs: list[str]) -> float:
    """Bits per UTF-8 byte of the paragraphs as continue examples (each token of the text, not the end
    token): comparable across tokenizers. The windows are the model's own context length."""
    prefix = tok.tasks["continue"]["prefix"]  # tok from load_tokenizer
    eos = model.config.eos_token_id
    ids, weights = [], []
    for p in paragraphs:
        body = encode_text(tok, p)
        ids += prefix + body + [eos]
        weights += [0] * len(prefix) + [1] * len(body) + [0]
    nats, _ = stream_loss(model, np.array(ids), np.array(weights, dtype=np.float32), model.config.max_position_embeddings)
    return nats / math.log(2) / sum(len(p.encode("utf-8")) for p in paragraphs)


def overlap_f1(got: str, expected: str) -> float:
    """Word overlap of two strings (lower-cased words, as SQuAD's F1)."""
    a, b = got.lower().split(), expected.lower().split()
    common = sum(min(a.count(w), b.count(w)) for w in set(a))
    if not common:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def evaluate(out: Path, corpus: Corpus, cfg: TrainConfig, n_proofread: int = 200, n_summarize: int = 200,
             against: Path | None = None) -> dict:
    """Bits per byte on validation text (the whole validation split, and the Python docs' validation
    text that the first base was measured on), proofread exact-fix, summarize exact-match and word
    overlap, and unedited samples; with `against` (another base, e.g. the one shipped before), its
    scores on the same text, sentences and passages."""
    tok = load_tokenizer(out)
    validation = set(corpus.validation)
    python_validation = [p for p in load_corpus(PYTHON).validation if p in validation]

    def fits(task: str, text: str) -> bool:  # room for an answer in the context window
        return len(encode_prompt(tok, task, text)) + 16 <= cfg.block_size

    proofread = [(t, c) for t, c in proofread_pairs(corpus.validation, cfg.seed + 1) if fits("proofread", t)][:n_proofread]
    passages = [(p, t) for p, t in summary_pairs(corpus.validation_sections) if fits("summarize", p)][:n_summarize]
    samples = [p for p in validation_prompts(corpus, 3, seed=cfg.seed + 2, tasks=tuple(tok.tasks)) if fits(p["task"], p["prompt"])]
    texts = {"bits_per_byte": corpus.validation, "bits_per_byte_python_validation": python_validation}
    v = {**scores(out, texts, proofread, passages, samples), "python_validation_paragraphs": len(python_validation)}
    if against is not None:
        c = load_config(against)
        v["against"] = {"base": str(against), "shape": f"{c['num_hidden_layers']} layers x {c['hidden_size']}",
                        **scores(against, texts, proofread, passages, [])}
    return v


def scores(directory: Path, texts: dict[str, list[str]], proofread, passages, samples) -> dict:
    """One base's measures on the given validation text, proofread pairs and summarize passages (a prompt
    longer than its context window counts as a failure; summarize only if its tokenizer offers it)."""
    model, tok = load_llama(directory), load_tokenizer(directory)
    eos, ctx = model.config.eos_token_id, model.config.max_position_embeddings

    def answer(task: str, text: str, most: int = 64) -> str:
        prompt = encode_prompt(tok, task, text)
        if len(prompt) >= ctx:
            return ""
        return decode(tok, decode_ar(model, prompt, min(most, ctx - len(prompt)), eos).ids).strip()

    v = {name: bits_per_byte(model, tok, paragraphs) for name, paragraphs in texts.items()}
    v |= {"proofread_exact_fix": sum(answer("proofread", typo) == correct for typo, correct in proofread) / max(1, len(proofread)),
          "proofread_evaluated": len(proofread)}
    if "summarize" in tok.tasks:
        summaries = [(answer("summarize", passage), title) for passage, title in passages]
        v |= {"summarize_exact": sum(g == t for g, t in summaries) / max(1, len(summaries)),
              "summarize_overlap_f1": sum(overlap_f1(g, t) for g, t in summaries) / max(1, len(summaries)),
              "summarize_evaluated": len(summaries)}
    v["samples"] = [{**p, "output": answer(p["task"], p["prompt"], 48)} for p in samples]
    return v


def train_and_report(out: Path, cfg: TrainConfig, run_dir: Path, device: str | None = None,
                     model_cfg: LlamaConfig | None = None, corpus: Corpus | None = None, n_eval: int = 200,
                     against: Path | None = None) -> dict:
    """What `train-base` does: train (or resume) in run_dir, save to out, evaluate on validation (and
    `against`, another base, on the same text), write the card. model_cfg, corpus and n_eval (validation
    prompts per task) make small runs for tests."""
    unknown = [s for s in cfg.sources if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown corpus source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
    missing = missing_packages(cfg.sources)
    if missing and not (run_dir / "data.json").is_file():
        raise DataError(f"the corpus needs Debian's documentation packages: apt-get install {' '.join(missing)}")
    model, tok, log = train_base(run_dir, cfg, model_cfg, corpus, device=device)
    out.mkdir(parents=True, exist_ok=True)
    save_llama(model, out)
    tok.save(str(out / "tokenizer.json"))
    sections = [(h, paras) for h, paras in json.loads((run_dir / "validation.json").read_text())]
    validation = Corpus([], [p for _, paras in sections for p in paras], (0, 0), validation_sections=sections)
    logger.info("evaluating on the validation text%s", f" (and {against}, to compare)" if against else "")
    log["validation"] = evaluate(out, validation, cfg, n_eval, n_eval, against)
    (out / "train_log.json").write_text(json.dumps(log, indent=2, ensure_ascii=False) + "\n")
    write_card(out, log)
    return log


def write_card(out: Path, log: dict) -> None:
    """The base's card, rendered from templates/base_card.md.j2 (the numbers come from the log and config.json)."""
    render_card(out, "base_card.md.j2", log=log, c=load_config(out))
