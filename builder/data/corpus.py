"""Training data: English prose from Debian's documentation packages, and the three tasks built from it.

Sources (`SOURCES`): the documentation of Python, PostgreSQL, Perl, Git, Django, SQLite, Node.js, the
Apache HTTP server, Sphinx and Debian's own manuals, each installed by one Debian package, in one of
three formats: reStructuredText sources (Sphinx `_sources/`), HTML, or Perl's POD. Each file becomes a
document: a list of sections, each a heading and its prose paragraphs. Only prose is kept: code,
literal blocks, tables, navigation and directives are dropped and inline markup is reduced to its
text; a paragraph must read as a sentence (at least 60 characters, mostly letters, ending with a
period or colon).

Files are split into train and validation by a hash of their path below the source's root (1 in 20 to
validation): Python's files fall exactly as they did when Python was the only source, so the old base's
validation text is still validation text. Validation drops the paragraphs that also occur in a training
file, so no validation text is ever trained on; training keeps each distinct paragraph once.
"""
from __future__ import annotations

import glob
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

from ..errors import DataError

VALIDATION_EVERY = 20  # one file in 20 goes to validation


@dataclass(frozen=True)
class Source:
    package: str    # the Debian package that installs it
    root: str       # its directory (a glob pattern where the path holds a version)
    pattern: str    # its files, below root (glob patterns separated by spaces)
    kind: str       # "rst" | "html" | "pod"
    licence: str
    exclude: tuple[str, ...] = ()  # file and folder names left out (indexes, code listings, pages that repeat others)


SPHINX_SKIP = ("_modules", "_sources", "_static", "_downloads", "genindex.html", "py-modindex.html", "search.html")
SOURCES: dict[str, Source] = {s.package: s for s in [
    Source("python3.11-doc", "/usr/share/doc/python3.11/html/_sources", "**/*.rst.txt", "rst", "PSF License Agreement"),
    Source("postgresql-doc-15", "/usr/share/doc/postgresql-doc-15/html", "*.html", "html", "PostgreSQL License (BSD-style)"),
    Source("perl-doc", "/usr/share/perl/5.*/pod", "*.pod", "pod", "GPL-1+ or Artistic"),
    Source("perl-modules-5.36", "/usr/share/perl/5.*", "**/*.pm", "pod", "GPL-1+ or Artistic"),
    Source("git-doc", "/usr/share/doc/git-doc", "**/*.html", "html", "GPL-2"),
    Source("python-django-doc", "/usr/share/doc/python-django-doc/html", "**/*.html", "html", "BSD-3-Clause",
           ("genindex.html", "py-modindex.html", "search.html")),
    Source("sqlite3-doc", "/usr/share/doc/sqlite3", "**/*.html", "html", "public domain"),
    Source("nodejs-doc", "/usr/share/doc/nodejs/api", "*.html", "html", "Expat (MIT)", ("all.html", "index.html")),
    Source("apache2-doc", "/usr/share/doc/apache2-doc/manual/en", "**/*.html", "html", "Apache-2.0"),
    Source("debian-handbook", "/usr/share/doc/debian-handbook/html/en-US", "*.html", "html", "GPL-2+ or CC-BY-SA-3.0"),
    Source("debian-reference-en", "/usr/share/debian-reference", "*.en.html", "html", "GPL-2+"),
    Source("debian-policy", "/usr/share/doc/debian-policy/policy.html/_sources", "**/*.txt", "rst", "GPL-2+"),
    Source("developers-reference", "/usr/share/developers-reference/_sources", "**/*.txt", "rst", "GPL-2"),
    Source("maint-guide", "/usr/share/doc/maint-guide/html", "*.en.html", "html", "GPL-2+ or MIT"),
    Source("sphinx-doc", "/usr/share/doc/sphinx-doc/html/_sources", "**/*.txt", "rst", "BSD-2-Clause"),
    Source("rust-doc", "/usr/share/doc/rust-doc/html", "book/**/*.html reference/**/*.html nomicon/**/*.html "
           "rust-by-example/**/*.html edition-guide/**/*.html rustc/**/*.html embedded-book/**/*.html std/**/*.html",
           "html", "MIT or Apache-2.0", ("print.html", "toc.html", "404.html", "all.html")),
    Source("python-sqlalchemy-doc", "/usr/share/doc/python-sqlalchemy-doc/rst", "**/*.rst", "rst", "Expat (MIT)", ("changelog",)),
    Source("linux-doc-6.1", "/usr/share/doc/linux-doc-6.1/html/_sources", "**/*.txt", "rst", "GPL-2"),
    Source("cmake-doc", "/usr/share/doc/cmake-data/html/_sources", "**/*.txt", "rst", "BSD-3-Clause"),
    Source("gimp-help-en", "/usr/share/gimp/2.0/help/en", "**/*.html", "html", "GFDL-1.2+ (no invariant sections)"),
    Source("wireshark-doc", "/usr/share/doc/wireshark", "wsug_html_chunked/*.html wsdg_html_chunked/*.html", "html", "GPL-2+"),
    Source("octave-doc", "/usr/share/doc/octave/octave.html", "*.html", "html", "GPL-3+"),
    Source("zsh-doc", "/usr/share/doc/zsh-common/html", "*.html", "html", "Zsh licence (MIT-style)"),
    Source("postfix-doc", "/usr/share/doc/postfix/html", "*.html", "html", "IPL-1.0 or EPL-2.0"),
    Source("erlang-doc", "/usr/share/doc/erlang-doc", "doc/**/*.html lib/*/doc/html/*.html", "html", "Apache-2.0"),
    Source("lilypond-doc-html", "/usr/share/doc/lilypond/html/Documentation", "learning/*.html notation/*.html "
           "usage/*.html essay/*.html extending/*.html contributor/*.html music-glossary/*.html", "html", "GFDL-1.1+ (no invariant sections)"),
    Source("gnucash-docs", "/usr/share/doc/gnucash-docs", "gnucash-guide-en/*.html gnucash-help-en/*.html", "html",
           "GFDL-1.1+ (no invariant sections)"),
    Source("openjdk-17-doc", "/usr/share/doc/openjdk-17-jre-headless/api", "java.base/**/*.html java.sql/**/*.html "
           "java.logging/**/*.html java.net.http/**/*.html java.xml/**/*.html", "html", "GPL-2 with the Classpath exception",
           ("class-use", "package-tree.html", "package-use.html")),
    Source("llvm-15-doc", "/usr/share/doc/llvm-15-doc/html/_sources", "**/*.txt", "rst", "Apache-2.0 with LLVM exceptions", ("AMDGPU",)),
    Source("clang-15-doc", "/usr/share/doc/clang-15/html/_sources", "**/*.txt", "rst", "Apache-2.0 with LLVM exceptions"),
    Source("libboost1.74-doc", "/usr/share/doc/libboost1.74-doc", "doc/html/**/*.html libs/**/*.html", "html", "BSL-1.0"),
    Source("weechat-doc", "/usr/share/doc/weechat-doc/html", "*.en.html", "html", "GPL-3+"),
    Source("grass-doc", "/usr/share/doc/grass-doc/html", "*.html", "html", "GPL-2+"),
    Source("freedombox-doc-en", "/usr/share/freedombox/manual/en", "*.html", "html", "AGPL-3+"),
    *(Source(f"python-{name}-doc", f"/usr/share/doc/python-{name}-doc/html", "**/*.html", "html", licence, SPHINX_SKIP)
      for name, licence in [("sympy", "BSD-3-Clause"), ("astropy", "BSD-3-Clause"),
                            ("sklearn", "BSD-3-Clause"), ("statsmodels", "BSD-3-Clause"), ("scipy", "BSD-3-Clause"),
                            ("dask", "BSD-3-Clause"), ("celery", "BSD-3-Clause"), ("pandas", "BSD-3-Clause"),
                            ("pytest", "Expat (MIT)")]),
]}
PYTHON = ("python3.11-doc",)  # the first base's only source: what the tests and the old validation text need
# the head's and the drafter's training text: eight of the base's sources that parse in seconds (25 s in all,
# against 10-20 minutes for all 43) and still give every task, summarize passages included, in variety
HEAD_SOURCES = ("python3.11-doc", "postgresql-doc-15", "perl-doc", "git-doc", "python-django-doc", "sqlite3-doc",
                "linux-doc-6.1", "llvm-15-doc")

Section = tuple[str, list[str]]  # (heading, its prose paragraphs); "" before a document's first heading


@dataclass
class Corpus:
    train: list[str]  # prose paragraphs
    validation: list[str]
    files: tuple[int, int]  # (train files, validation files)
    train_sections: list[Section] = field(default_factory=list)
    validation_sections: list[Section] = field(default_factory=list)
    sources: dict[str, dict] = field(default_factory=dict)  # package -> files, paragraphs and characters per split


def is_validation(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def source_files(source: Source) -> tuple[Path, list[Path]]:
    roots = sorted(glob.glob(source.root))
    if not roots or not Path(roots[-1]).is_dir():
        raise DataError(f"{source.root} not found: install Debian's {source.package} package "
                        f"(apt-get install {source.package})")
    root = Path(roots[-1])
    files = {p for pattern in source.pattern.split() for p in root.glob(pattern) if p.is_file()}
    return root, sorted(p for p in files if not set(p.relative_to(root).parts) & set(source.exclude))


def missing_packages(sources) -> list[str]:
    """The Debian packages of the named sources that are not installed."""
    missing = []
    for name in sources:
        try:
            source_files(SOURCES[name])
        except DataError:
            missing.append(SOURCES[name].package)
    return missing


def document_sections(path: Path, kind: str) -> list[Section]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return {"rst": rst_sections, "html": html_sections, "pod": pod_sections}[kind](text)


def load_corpus(sources: tuple[str, ...] | list[str] = PYTHON) -> Corpus:
    """The prose of the named sources (default: the Python docs alone), split by file."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown corpus source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
    missing = missing_packages(sources)
    if missing:
        raise DataError(f"the corpus needs Debian's documentation packages: apt-get install {' '.join(missing)}")
    split: dict[bool, list[tuple[str, list[Section]]]] = {False: [], True: []}
    for name in sources:
        root, files = source_files(SOURCES[name])
        for path in files:
            rel = str(path.relative_to(root))
            split[is_validation(rel)].append((name, document_sections(path, SOURCES[name].kind)))
    seen, train_sections, stats = set(), [], {}
    for name, doc in split[False]:  # each distinct training paragraph once, in file order
        for heading, paras in doc:
            paras = [p for p in dict.fromkeys(paras) if p not in seen]
            seen.update(paras)
            train_sections.append((heading, paras))
            _count(stats, name, "train", paras)
        _count(stats, name, "train_files", [])
    validation_sections = []
    for name, doc in split[True]:  # boilerplate repeated across files stays out of validation
        for heading, paras in doc:
            paras = [p for p in paras if p not in seen]
            validation_sections.append((heading, paras))
            _count(stats, name, "validation", paras)
        _count(stats, name, "validation_files", [])
    flat = lambda secs: [p for _, paras in secs for p in paras]  # noqa: E731
    return Corpus(flat(train_sections), flat(validation_sections), (len(split[False]), len(split[True])),
                  train_sections, validation_sections, stats)


def _count(stats: dict, name: str, what: str, paras: list[str]) -> None:
    s = stats.setdefault(name, {"licence": SOURCES[name].licence, "train_files": 0, "validation_files": 0,
                                "train_paragraphs": 0, "train_chars": 0,
                                "validation_paragraphs": 0, "validation_chars": 0})
    if what.endswith("_files"):
        s[what] += 1
    else:
        s[f"{what}_paragraphs"] += len(paras)
        s[f"{what}_chars"] += sum(map(len, paras))


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


def is_prose(text: str) -> bool:
    """A paragraph that reads as sentences: long enough, mostly letters, ending like a sentence."""
    return len(text) >= 60 and text[-1] in ".:" and sum(c.isalpha() for c in text) >= 0.7 * len(text)


def prose(text: str) -> str:
    return text[:-1] + "." if text.endswith(":") else text  # "as follows:" ends a paragraph whose example was cut


def clean_heading(text: str) -> str:
    """A heading without its numbering ("9.7.3. ", "Chapter 4. ") or permalink sign."""
    text = re.sub(r"\s+", " ", text.replace("\u00b6", "").replace("#", " ")).strip()
    return re.sub(r"^(?:(?:Chapter|Appendix|Part|Section)\s+)?(?:[\dA-Z]{1,3}\.)*\d*\.?\s+(?=\S)", "", text).strip()


def rst_sections(source: str) -> list[Section]:
    """The sections of a reStructuredText file: each heading and the prose paragraphs under it.

    Indented blocks count too (the library reference describes each function in the indented body of
    a directive); code and literal blocks fall to the prose test (mostly letters, ends with a period).
    """
    sections: list[Section] = [("", [])]
    for block in re.split(r"\n\s*\n", source):
        lines = [l.strip() for l in block.split("\n")]
        first = lines[0]
        if not first or first.startswith(("..", "|", "+", "=", ">>>", "...", ":")):
            continue  # directive, comment, table, doctest, field list
        rules = [i for i, l in enumerate(lines) if re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", l)]
        if rules:  # a section heading: its text is the line above the underline
            title = [l for i, l in enumerate(lines) if i not in rules]
            if len(title) == 1:
                sections.append((clean_heading(clean_inline(title[0])), []))
            continue
        lines[0] = re.sub(r"^(?:[*-]|#\.|\d+\.)\s+", "", first)  # a list item's bullet
        text = clean_inline(" ".join(lines))
        if is_prose(text):
            sections[-1][1].append(prose(text))
    return [s for s in sections if s[1]]


def rst_paragraphs(source: str) -> list[str]:
    return [p for _, paras in rst_sections(source) for p in paras]


class _ProseHTML(HTMLParser):
    """Collects headings and the text of paragraph-like elements, skipping code, tables and navigation."""
    SKIP = {"pre", "table", "script", "style", "nav", "header", "footer", "form", "svg", "math", "select", "button"}
    SKIP_CLASS = re.compile(r"nav|sidebar|related|footer|header|toc|breadcrumb|admonition-title|highlight|"
                            r"headerlink|copyright|legalnotice|example|programlisting|synopsis|screen")
    BLOCKS = {"p", "li", "dd", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = [("", [])]
        self.skip: list[str] = []  # tags of the skipped elements we are inside, innermost last
        self.block, self.text = None, []

    def handle_starttag(self, tag, attrs):
        if self.skip:
            if tag == self.skip[-1]:
                self.skip.append(tag)
            return
        cls = dict(attrs).get("class") or ""
        if tag == "div" and {"para", "block"} & set(cls.split()):  # DocBook's Publican HTML, javadoc
            self.flush()
            self.block = "p"
        elif tag in self.SKIP or (tag in ("div", "span", "a", "section", "aside", "code", "p") and self.SKIP_CLASS.search(cls)):
            self.skip.append(tag)
        elif tag in self.BLOCKS:
            self.flush()
            self.block = tag

    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[-1]:
                self.skip.pop()
            return
        if tag in self.BLOCKS or (tag == "div" and self.block == "p"):
            self.flush()

    def handle_data(self, data):
        if not self.skip and self.block:
            self.text.append(data)

    def flush(self):
        text = re.sub(r"\s+", " ", "".join(self.text)).strip()
        if self.block and self.block.startswith("h"):
            self.sections.append((clean_heading(text), []))
        elif self.block and is_prose(text):
            self.sections[-1][1].append(prose(text))
        self.block, self.text = None, []


def html_sections(source: str) -> list[Section]:
    parser = _ProseHTML()
    parser.feed(source)
    parser.close()
    parser.flush()
    return [s for s in parser.sections if s[1]]


_POD_CODE = re.compile(r"([A-Z])<(?!<)([^<>]*)>")        # B<bold>, C<code>, L<text|link>, E<gt>
_POD_CODE2 = re.compile(r"([A-Z])<<+\s+(.*?)\s+>>+")      # C<< $a <=> $b >>
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&"}


def _pod_code(m: re.Match) -> str:
    code, body = m.group(1), m.group(2)
    if code == "E":
        return _POD_ESCAPES.get(body, unescape(f"&{body};") if not body.isdigit() else chr(int(body)))
    if code in "XZ":
        return ""
    if code == "L":
        text = body.split("|")[0] if "|" in body else body
        return text.replace('"', "").replace("/", " ").strip()
    return body


def pod_sections(source: str) -> list[Section]:
    """The sections of a Perl POD file or module: =head headings and ordinary (not verbatim) paragraphs."""
    sections: list[Section] = [("", [])]
    in_pod, skip = False, False  # a .pm file starts with code; any command paragraph starts POD
    for block in re.split(r"\n\s*\n", source):
        if block.startswith("=cut"):
            in_pod = False
        elif re.match(r"=[a-z]", block):
            in_pod = True
        if not in_pod or not block.strip():
            continue
        if block.startswith(("=begin", "=for")):
            skip = block.startswith("=begin")
            continue
        if block.startswith("=end"):
            skip = False
            continue
        if skip or block[0] in " \t":
            continue  # a =begin..=end region or a verbatim (code) paragraph
        text = _POD_CODE2.sub(lambda m: m.group(2), block)
        for _ in range(4):  # nested codes, innermost first
            text = _POD_CODE.sub(_pod_code, text)
        text = re.sub(r"\s+", " ", text).strip()
        if block.startswith("=head"):
            sections.append((clean_heading(text.split(" ", 1)[1] if " " in text else ""), []))
        elif not block.startswith("=") and is_prose(text):
            sections[-1][1].append(prose(text))
    return [s for s in sections if s[1]]


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


# --- the summarize task ----------------------------------------------------------------------------

SUMMARY_CHARS = (20, 120)    # a heading of about 5-30 tokens
PASSAGE_CHARS = (400, 1600)  # a passage of about 100-400 tokens


def is_title(heading: str) -> bool:
    """A heading that says what its section is about in words (not "Notes", not a function signature)."""
    words = heading.split()
    return (SUMMARY_CHARS[0] <= len(heading) <= SUMMARY_CHARS[1] and len(words) >= 3
            and sum(c.isalpha() or c == " " for c in heading) >= 0.85 * len(heading)
            and sum(w[0].isalpha() for w in words) >= 0.8 * len(words))


def summary_pairs(sections: list[Section]) -> list[tuple[str, str]]:
    """(passage, summary) pairs: the first paragraphs of a section (PASSAGE_CHARS long, joined by
    newlines) and the section's heading, for headings that read as a title and occur only once in the
    corpus (a heading repeated across documents, "Deprecated API", summarizes none of them)."""
    counts: dict[str, int] = {}
    for heading, _ in sections:
        counts[heading.lower()] = counts.get(heading.lower(), 0) + 1
    out = []
    for heading, paras in sections:
        if counts[heading.lower()] > 1 or not is_title(heading):
            continue
        passage = []
        for p in paras:
            if len("\n".join(passage + [p])) > PASSAGE_CHARS[1]:
                break
            passage.append(p)
        text = "\n".join(passage)
        if len(text) >= PASSAGE_CHARS[0]:
            out.append((text, heading))
    return out


def prompts_digest(prompts: list[dict]) -> str:
    """The first 16 hex digits of the sha256 of the prompts' (task, prompt) pairs: which held-back prompts a
    tau was measured on (another version of the installed documentation gives other prompts)."""
    return hashlib.sha256(json.dumps([(p["task"], p["prompt"]) for p in prompts]).encode()).hexdigest()[:16]


def validation_prompts(corpus: Corpus, n_per_task: int, seed: int = 1,
                       tasks: tuple[str, ...] = ("continue", "proofread")) -> list[dict]:
    """Prompts of the tasks from validation files only: never seen in training.

    continue: the first 6-14 words of a validation paragraph; proofread: a validation sentence with
    typos (its correct form under "expected"); summarize: a validation passage (its heading under
    "expected").
    """
    rng = random.Random(seed)
    paragraphs = rng.sample(corpus.validation, min(n_per_task, len(corpus.validation)))
    out = [{"prompt": " ".join(p.split()[: rng.randint(6, 14)]), "task": "continue"} for p in paragraphs]
    pairs = proofread_pairs(corpus.validation, seed)
    pairs = rng.sample(pairs, min(n_per_task, len(pairs)))
    out += [{"prompt": typo, "task": "proofread", "expected": fixed} for typo, fixed in pairs]
    if "summarize" in tasks:
        pairs = summary_pairs(corpus.validation_sections)
        pairs = rng.sample(pairs, min(n_per_task, len(pairs)))
        out += [{"prompt": passage, "task": "summarize", "expected": title} for passage, title in pairs]
    if "reply" in tasks:  # a validation paragraph as the message to answer
        out += [{"prompt": " ".join(p.split()[:80]), "task": "reply"}
                for p in rng.sample(corpus.validation, min(n_per_task, len(corpus.validation)))]
    return [p for p in out if p["task"] in tasks]
