"""Training data: English prose from the Python 3.11 documentation, and the two tasks built from it.

Source: the reStructuredText sources in Debian's `python3.11-doc` package
(/usr/share/doc/python3.11/html/_sources, PSF License Agreement). Only prose paragraphs are kept:
directives, code and literal blocks, tables and headings are dropped and inline markup is reduced to
its text. Files are split into train and validation by a hash of their path (1 in 20 to validation),
and validation drops the few paragraphs that also occur in a training file, so no validation text
is ever trained on.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
VALIDATION_EVERY = 20  # one file in 20 goes to validation


class DataError(Exception):
    pass


@dataclass
class Corpus:
    train: list[str]  # prose paragraphs
    validation: list[str]
    files: tuple[int, int]  # (train files, validation files)


def is_validation(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def load_corpus(root: Path = DOC_SOURCES) -> Corpus:
    if not root.is_dir():
        raise DataError(f"{root} not found: install Debian's python3.11-doc package (apt-get install python3.11-doc)")
    train, val, n = [], [], [0, 0]
    for path in sorted(root.rglob("*.rst.txt")):
        rel = str(path.relative_to(root))
        paragraphs = rst_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
        (val if is_validation(rel) else train).extend(paragraphs)
        n[is_validation(rel)] += 1
    seen = set(train)  # boilerplate repeated across files stays out of validation
    return Corpus(train, [p for p in val if p not in seen], (n[0], n[1]))


TEXT_SUFFIXES = (".txt", ".md", ".rst")
MIN_WORDS = 8  # a paragraph of the user's text needs this many words to be used


def load_text_corpus(path: Path) -> Corpus:
    """The user's own text (`train-head --data PATH`): a UTF-8 text file, or a directory of .txt, .md and
    .rst files (searched recursively). Paragraphs are the blocks between blank lines, whitespace
    collapsed, of at least MIN_WORDS words. Every VALIDATION_EVERY-th paragraph is held back (never
    trained on, and dropped if the same text is also in the training part)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"--data {path}: no such file or directory")
    if not files:
        raise DataError(f"--data {path}: no {', '.join(TEXT_SUFFIXES)} files in it")
    paragraphs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        blocks = (" ".join(b.split()) for b in re.split(r"\n\s*\n", text))
        paragraphs += [b for b in blocks if len(b.split()) >= MIN_WORDS]
    train = [p for i, p in enumerate(paragraphs) if i % VALIDATION_EVERY]
    seen = set(train)
    val = [p for i, p in enumerate(paragraphs) if i % VALIDATION_EVERY == 0 and p not in seen]
    if len(train) < 20 or len(val) < 2:
        raise DataError(f"--data {path}: {len(paragraphs)} paragraphs of at least {MIN_WORDS} words, too few to "
                        f"train on and hold back (need at least 40, separated by blank lines)")
    return Corpus(train, val, (len(files), len(files)))


_ROLE = re.compile(r":[\w:.-]+:`(?:~|!)?([^`<]*?)\s*(?:<[^`>]*>)?`")  # :func:`~a.b <x>` -> a.b
_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`__?")                 # `text <url>`_ -> text
_LITERAL = re.compile(r"``(.+?)``")
_EMPH = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
_FOOTNOTE = re.compile(r"\s*\[(?:#\w*|\d+|\*)\]_")


def clean_inline(text: str) -> str:
    text = _ROLE.sub(lambda m: m.group(1).lstrip("~!"), text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    text = _FOOTNOTE.sub("", text)
    text = text.replace("::", ":").replace("\\", "")
    return re.sub(r"\s+", " ", text).strip()


def rst_paragraphs(source: str) -> list[str]:
    """Prose paragraphs of a reStructuredText file: blocks that read as sentences.

    Indented blocks count too (the library reference describes each function in the indented body of
    a directive); code and literal blocks fall to the prose test (mostly letters, ends with a period).
    """
    out = []
    for block in re.split(r"\n\s*\n", source):
        lines = [l.strip() for l in block.split("\n")]
        first = lines[0]
        if not first or first.startswith(("..", "|", "+", "=", ">>>", "...", ":")):
            continue  # directive, comment, table, doctest, field list
        if any(re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", l) for l in lines):
            continue  # a section heading
        lines[0] = re.sub(r"^(?:[*-]|#\.|\d+\.)\s+", "", first)  # a list item's bullet
        text = clean_inline(" ".join(lines))
        if len(text) < 60 or not text[-1] in ".:" or sum(c.isalpha() for c in text) < 0.7 * len(text):
            continue
        out.append(text[:-1] + "." if text.endswith(":") else text)
    return out


# --- the proofread task -----------------------------------------------------------------------------

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
COMMON_MISSPELLINGS = {
    "the": "teh", "receive": "recieve", "separate": "seperate", "definitely": "definately",
    "which": "wich", "occurred": "occured", "necessary": "neccessary", "argument": "arguement",
    "until": "untill", "beginning": "begining", "believe": "beleive", "environment": "enviroment",
    "existence": "existance", "independent": "independant", "occurrence": "occurence",
    "successful": "succesful", "whether": "wether", "because": "becuase", "function": "funtion",
    "their": "thier", "length": "lenght", "parameter": "paramter", "returns": "retuns",
    "attribute": "atribute", "different": "diffrent", "reference": "refrence", "similar": "similiar",
    "immediately": "immediatly", "accommodate": "accomodate", "address": "adress", "with": "wiht",
    "object": "obejct", "value": "vaule", "module": "moduel", "string": "strign", "there": "ther",
}
_NEIGHBOURS = dict(zip("qwertyuiopasdfghjklzxcvbnm", [
    "wa", "qes", "wrd", "etf", "ryg", "tuh", "yij", "uok", "ipl", "ol", "qsz", "awdx", "sefc", "drgv",
    "fthb", "gyjn", "hukm", "jil", "kop", "zsx", "xdc", "cfv", "vgb", "bhn", "nj", "mk"]))


def sentences(paragraphs: list[str]) -> list[str]:
    """Sentences of 30-160 characters that are mostly words (good material for typos)."""
    out = []
    for p in paragraphs:
        for s in _SENTENCE.split(p):
            if 30 <= len(s) <= 160 and s[-1] in ".!?" and sum(c.isalpha() or c == " " for c in s) > 0.9 * len(s):
                out.append(s)
    return out


def add_typos(sentence: str, rng: random.Random) -> str:
    """1-3 typos: a dropped, swapped, doubled or substituted letter, or a common misspelling."""
    words = sentence.split(" ")
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        idx = [i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 3]
        if not idx:
            break
        i = rng.choice(idx)
        w = words[i]
        core = w.strip(".,;:!?()\"'").lower()
        if core in COMMON_MISSPELLINGS and rng.random() < 0.5:
            words[i] = w.replace(core, COMMON_MISSPELLINGS[core]) if core in w else w
            continue
        letters = [j for j, c in enumerate(w) if c.isalpha()]
        j = rng.choice(letters)
        kind = rng.choice(("drop", "swap", "double", "substitute"))
        if kind == "drop":
            w = w[:j] + w[j + 1:]
        elif kind == "swap" and j + 1 < len(w) and w[j + 1].isalpha() and w[j] != w[j + 1]:
            w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
        elif kind == "double":
            w = w[:j] + w[j] + w[j:]
        else:
            c = w[j].lower()
            sub = rng.choice(_NEIGHBOURS.get(c, "e"))
            w = w[:j] + (sub.upper() if w[j].isupper() else sub) + w[j + 1:]
        words[i] = w
    typo = " ".join(words)
    return typo if typo != sentence else add_typos(sentence, rng)


def proofread_pairs(paragraphs: list[str], seed: int) -> list[tuple[str, str]]:
    """(sentence with typos, correct sentence) for every usable sentence, deterministic per seed."""
    rng = random.Random(seed)
    return [(add_typos(s, rng), s) for s in sentences(paragraphs)]


def validation_prompts(corpus: Corpus, n_per_task: int, seed: int = 1) -> list[dict]:
    """Prompts of both tasks from validation files only: never seen in training.

    continue: the first 6-14 words of a validation paragraph; proofread: a validation sentence with
    typos (its correct form under "expected").
    """
    rng = random.Random(seed)
    paragraphs = rng.sample(corpus.validation, min(n_per_task, len(corpus.validation)))
    out = [{"prompt": " ".join(p.split()[: rng.randint(6, 14)]), "task": "continue"} for p in paragraphs]
    pairs = proofread_pairs(corpus.validation, seed)
    pairs = rng.sample(pairs, min(n_per_task, len(pairs)))
    out += [{"prompt": typo, "task": "proofread", "expected": fixed} for typo, fixed in pairs]
    return out
