"""Everyday text for the features' adapters: real chat messages, real misspellings, real replies.

Sources, all from registry packages (nothing is downloaded at run time):
- `chitchat-dataset` (PyPI, MIT): 7,168 open-domain conversations between people (BYU PCC lab), 258 k
  messages. A conversation is a list of turns, a turn one person's consecutive messages.
- `codespell` (PyPI, GPL-2.0, its data only): its dictionary of common misspellings (`becuase->because`),
  inverted into the misspellings of each correct word.
- Debian's `wamerican` word list (/usr/share/dict/words): which words are spelled right.

Every conversation belongs to one split by a hash of its id (`split_of`): a tenth is "eval", never trained
on, and the held-out sets of every feature come from it alone, less any text that a training conversation
also holds (many conversations open with the same greetings and questions).

- proofread: sentences a person wrote that the word list finds no fault in (`clean_sentences`), with real
  mistakes injected (`inject_errors`): codespell's misspellings, homophones (your/you're, their/there,
  its/it's, then/than, ..), dropped apostrophes (dont, wont, im), lower-case day and month names and "i",
  doubled or dropped letters. The target is the sentence as its author wrote it; a share of the pairs are
  clean sentences whose target is themselves (a proofreader must leave correct text alone).
- reply: a person's turn and the other person's next turn (`reply_pairs`), the reply 1-15 words, spelled right.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

from ..errors import CheckpointError

WORDS = Path("/usr/share/dict/words")
EVAL_SHARE = 10  # one conversation in EVAL_SHARE is held out

# Homophones and near-homophones people confuse: each word of a group is written as another of it.
HOMOPHONES = [("your", "you're"), ("their", "there", "they're"), ("its", "it's"), ("then", "than"),
              ("to", "too"), ("were", "we're", "where"), ("lose", "loose"), ("affect", "effect"),
              ("whose", "who's"), ("accept", "except"), ("hear", "here"), ("weather", "whether"),
              ("brake", "break"), ("quite", "quiet"), ("passed", "past"), ("piece", "peace")]
# Contractions and how a hurried thumb writes them (some are words of their own: "wont", "cant", "ill").
NO_APOSTROPHE = {"don't": "dont", "won't": "wont", "can't": "cant", "I'm": "im", "didn't": "didnt",
                 "doesn't": "doesnt", "isn't": "isnt", "it's": "its", "that's": "thats", "I've": "ive",
                 "you're": "youre", "they're": "theyre", "wasn't": "wasnt", "couldn't": "couldnt",
                 "wouldn't": "wouldnt", "shouldn't": "shouldnt", "I'll": "ill", "I'd": "id", "let's": "lets",
                 "what's": "whats", "there's": "theres", "haven't": "havent", "aren't": "arent", "we're": "were"}
CAPITALISED = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "January",
               "February", "March", "April", "June", "July", "August", "September", "October", "November",
               "December", "I"]
APOSTROPHE_LESS = {v.lower() for v in NO_APOSTROPHE.values()} - {"its", "were", "lets", "ill", "id"}
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
# Text no feature is trained on (the conversations are unmoderated).
BLOCKED = re.compile(r"\b(fuck|shit|bitch|sex|porn|rape|nigg|fag|retard|kill|suicide|dick|cock|pussy|whore|slut)", re.I)


def need(package: str, module: str):
    try:
        return __import__(module)
    except ModuleNotFoundError:
        raise CheckpointError(f"everyday text comes from the {package} package, which is missing: bash .ci/setup, "
                              f"or pip install {package}") from None


@lru_cache(maxsize=1)
def words() -> frozenset[str]:
    """The words Debian's word list spells right, as it writes them (proper nouns capitalised)."""
    if not WORDS.is_file():
        raise CheckpointError(f"missing {WORDS}: install Debian's wamerican word list (bash .ci/setup)")
    return frozenset(w.strip() for w in WORDS.read_text(encoding="utf-8", errors="replace").splitlines() if w.strip())


@lru_cache(maxsize=1)
def misspellings() -> dict[str, list[str]]:
    """correct word -> its common misspellings, from codespell's dictionary (single words, letters only)."""
    need("codespell", "codespell_lib")
    out: dict[str, list[str]] = {}
    for line in (files("codespell_lib") / "data" / "dictionary.txt").read_text(encoding="utf-8").splitlines():
        typo, _, fixes = line.partition("->")
        fix = fixes.split(",")[0].strip()
        if fix and "," not in fixes.rstrip(",") and typo.isalpha() and fix.isalpha() and typo.islower() and typo not in words():
            out.setdefault(fix, []).append(typo)
    return out


def split_of(conversation_id: str) -> str:
    return "eval" if int(hashlib.sha256(conversation_id.encode()).hexdigest(), 16) % EVAL_SHARE == 0 else "train"


@lru_cache(maxsize=2)
def conversations(split: str) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The conversations of a split, in the package's order: each a tuple of turns, each turn the texts of one
    person's consecutive messages."""
    dataset = need("chitchat-dataset", "chitchat_dataset")
    data = dataset.Dataset()
    return tuple(tuple(tuple(m["text"].strip() for m in turn if m["text"].strip()) for turn in conv["messages"])
                 for cid, conv in data.items() if split_of(cid) == split)


def spelled_right(text: str, sentence: bool) -> bool:
    """Every word is in the word list (a sentence's first word may be capitalised), none is a known misspelling
    or a contraction without its apostrophe, and "I" is capitalised."""
    known, typos = words(), misspellings_set()
    for i, w in enumerate(WORD.findall(text)):
        if w == "i" or w.lower() in APOSTROPHE_LESS or w.lower() in typos:
            return False
        if w in known or (i == 0 and w[0].lower() + w[1:] in known):
            continue
        if not sentence and w.lower() in known:
            continue
        return False
    return True


@lru_cache(maxsize=1)
def misspellings_set() -> frozenset[str]:
    return frozenset(t for typos in misspellings().values() for t in typos)


def is_clean_sentence(text: str, min_words: int = 4, max_words: int = 30) -> bool:
    """A sentence a proofreader should leave alone: capitalised, ended by . ! or ?, ASCII, 4-30 words,
    every word spelled right."""
    n = len(text.split())
    return (min_words <= n <= max_words and text.isascii() and text[0].isupper() and text[-1] in ".!?"
            and "  " not in text and "http" not in text and not re.search(r"(.)\1\1", text)
            and not re.search(r"[.!?] +[^A-Z]", text) and not BLOCKED.search(text)
            and spelled_right(text, sentence=True))


@lru_cache(maxsize=2)
def clean_sentences(split: str) -> tuple[str, ...]:
    """Every distinct clean message (one or two sentences as a person sent it) of the split's conversations."""
    out: dict[str, None] = {}
    for conv in conversations(split):
        for turn in conv:
            for text in turn:
                if is_clean_sentence(text):
                    out.setdefault(text)
    if split == "eval":  # a text that a training conversation holds too ("How are you?") is not held out
        out = {t: None for t in out if t not in set(clean_sentences("train"))}
    return tuple(out)


def with_case(word: str, like: str) -> str:
    return word[0].upper() + word[1:] if like[0].isupper() else word


def word_errors(word: str) -> dict[str, list[str]]:
    """kind of mistake -> the ways a person might have written `word` wrong with it (kinds that do not apply
    are left out)."""
    lower = word.lower()
    out: dict[str, list[str]] = {}
    if lower in misspellings():
        out["misspelling"] = [with_case(t, word) for t in misspellings()[lower]]
    for group in HOMOPHONES:
        if lower in group:
            out["homophone"] = [with_case(w, word) for w in group if w != lower]
    for right, wrong in NO_APOSTROPHE.items():
        if word in (right, right.capitalize()):
            out["apostrophe"] = [with_case(wrong, word), wrong]
    if word in CAPITALISED:
        out["capital"] = [word.lower()]
    if len(word) >= 5 and word.isalpha():
        out["letters"] = ([word[:i] + word[i + 1:] for i in range(1, len(word) - 1)]  # a dropped letter
                          + [word[:i] + word[i] + word[i:] for i in range(1, len(word) - 1)])  # a doubled one
    return {kind: [w for w in ways if w != word] for kind, ways in out.items() if any(w != word for w in ways)}


# How often each kind of mistake is chosen, where the sentence offers it.
KINDS = {"misspelling": 0.3, "homophone": 0.2, "apostrophe": 0.2, "capital": 0.1, "letters": 0.2}


def inject_errors(sentence: str, rng: random.Random, n: int) -> str:
    """The sentence with up to n of its words written wrong: each time a kind of mistake (KINDS) the sentence
    still offers, then a word it applies to, then one way of writing it wrong."""
    options = {}  # kind -> [(start, end, wrong ways)]
    for m in WORD.finditer(sentence):
        for kind, ways in word_errors(m.group()).items():
            options.setdefault(kind, []).append((m.start(), m.end(), ways))
    chosen: dict[int, tuple[int, str]] = {}
    for _ in range(n):
        kinds = [k for k in KINDS if any(start not in chosen for start, _, _ in options.get(k, []))]
        if not kinds:
            break
        kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
        start, end, ways = rng.choice([o for o in options[kind] if o[0] not in chosen])
        chosen[start] = (end, rng.choice(ways))
    for start, (end, wrong) in sorted(chosen.items(), reverse=True):
        sentence = sentence[:start] + wrong + sentence[end:]
    return sentence


def proofread_pairs(split: str, n: int, seed: int, clean_share: float = 0.15) -> list[tuple[str, str]]:
    """n (sentence with mistakes, the sentence as written) pairs of the split, clean_share of them clean."""
    rng = random.Random(seed)
    sentences = list(clean_sentences(split))
    rng.shuffle(sentences)
    pairs = []
    for s in sentences:
        if len(pairs) == n:
            break
        if rng.random() < clean_share:
            pairs.append((s, s))
            continue
        wrong = inject_errors(s, rng, rng.choices([1, 2, 3], weights=[0.5, 0.35, 0.15])[0])
        if wrong != s:
            pairs.append((wrong, s))
    return pairs


def reply_pairs(split: str, n: int, seed: int, max_words: int = 15) -> list[tuple[str, str]]:
    """n (message, reply) pairs of the split: a person's turn that ends in a question (its messages joined,
    3-60 words: questions get answers that answer them; other turns are often answered with a change of
    subject) and the other person's next turn (1-max_words words, spelled right, first letter capitalised)."""
    out: dict[str, str] = {}
    for conv in conversations(split):
        for turn, answer in zip(conv, conv[1:]):
            message, reply = " ".join(turn), " ".join(answer)
            if not (3 <= len(message.split()) <= 60 and 1 <= len(reply.split()) <= max_words and "?" in turn[-1]):
                continue
            if BLOCKED.search(message + " " + reply) or re.search(r"anyone (here|there)|are you there", reply, re.I):
                continue
            if not (message.isascii() and reply.isascii()) or "http" in message + reply or re.search(r"(.)\1\1\1", reply):
                continue
            if spelled_right(reply, sentence=False):
                out.setdefault(message, reply[0].upper() + reply[1:])
    if split == "eval":  # a message that a training conversation holds too is not held out
        out = {m: r for m, r in out.items() if m not in training_turns()}
    pairs = sorted(out.items())
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


@lru_cache(maxsize=1)
def training_turns() -> frozenset[str]:
    """Every turn of the training conversations, its messages joined (as reply_pairs joins them)."""
    return frozenset(" ".join(turn) for conv in conversations("train") for turn in conv)


# --- summarize: notification stacks ------------------------------------------------------------------

# First names for the senders of a stack (the conversations' people are anonymous).
NAMES = ["Alex", "Sam", "Maya", "Leo", "Emma", "Noah", "Olivia", "Liam", "Ava", "Ethan", "Mia", "Lucas", "Zoe",
         "Ben", "Chloe", "Jack", "Grace", "Ryan", "Lily", "Owen", "Nora", "Adam", "Ella", "David", "Sara", "Omar",
         "Priya", "Chen", "Hana", "Diego", "Lena", "Tom", "Anna", "Kai", "Ruth", "Jamal", "Ines", "Marco", "Yuki", "Fatima"]
STORES = ["Green Market", "City Books", "Bright Electronics", "Corner Pharmacy", "Urban Shoes", "Home Depot", "Pet Pal",
          "Fresh Bakery", "Sunny Garden Center", "Blue Sky Travel"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def notice(rng: random.Random) -> str:
    """A notice as apps send them: delivery, bank, calendar, travel, appointment, bill (slots filled at random)."""
    store, day, name = rng.choice(STORES), rng.choice(DAYS), rng.choice(NAMES)
    date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
    hour = f"{rng.randint(1, 12)}:{rng.choice(['00', '15', '30', '45'])} {rng.choice(['AM', 'PM'])}"
    amount = f"${rng.randint(3, 400)}.{rng.randint(0, 99):02d}"
    order = rng.randint(1000, 99999)
    return rng.choice([
        f"Your order #{order} from {store} has shipped. Estimated delivery: {day}.",
        f"Your package from {store} was delivered at {hour}. It was left at the front door.",
        f"Card alert: a payment of {amount} to {store} was made with your card ending {rng.randint(1000, 9999)} on {date}.",
        f"Reminder: {rng.choice(['Dentist', 'Doctor', 'Haircut', 'Car service'])} appointment on {day} at {hour}. Reply C to confirm.",
        f"Your flight {rng.choice(['UA', 'DL', 'BA', 'LH'])}{rng.randint(100, 999)} to {rng.choice(['Boston', 'Denver', 'Chicago', 'Seattle', 'London'])} "
        f"is delayed. New departure: {hour}, gate {rng.choice('ABCD')}{rng.randint(1, 40)}.",
        f"Your {rng.choice(['electricity', 'phone', 'internet', 'water'])} bill of {amount} is due on {date}. Pay in the app to avoid a late fee.",
        f"{name} invited you to \"{rng.choice(['Team lunch', 'Book club', 'Birthday dinner', 'Game night'])}\" on {day} at {hour}.",
        f"Your ride is arriving in {rng.randint(2, 9)} minutes. Look for a {rng.choice(['white', 'black', 'silver', 'blue'])} "
        f"{rng.choice(['Toyota', 'Honda', 'Ford', 'Kia'])}, plate {rng.choice('ABCDEFG')}{rng.randint(100, 999)}{rng.choice('XYZ')}.",
    ])


def message_stack(conv: tuple[tuple[str, ...], ...], rng: random.Random, group_share: float = 0.35) -> str | None:
    """2-5 messages of a conversation as a phone stacks them, "Name: message" a line, or None when the
    conversation has no such run of clean, short messages. Mostly what one person sent you in a row (one
    turn of theirs: the reader is the other person, whose own messages never notify them); group_share of
    the time a group chat's window, two people writing to each other, each a name."""
    ok = lambda m: 2 <= len(m.split()) <= 30 and m.isascii() and "http" not in m and not BLOCKED.search(m)  # noqa: E731
    names = rng.sample(NAMES, 2)
    if rng.random() >= group_share:
        runs = [turn[s:s + 5] for turn in conv for s in range(len(turn) - 1) if all(ok(m) for m in turn[s:s + 2])]
        runs = [[m for m in r[:next((i for i, m in enumerate(r) if not ok(m)), len(r))]] for r in runs]
        if runs:
            run = rng.choice(runs)
            return "\n".join(f"{names[0]}: {m}" for m in run[:rng.randint(2, len(run))])
    flat = [(i % 2, m) for i, turn in enumerate(conv) for m in turn]
    n = rng.randint(2, 5)
    starts = [s for s in range(len(flat) - n + 1) if all(ok(m) for _, m in flat[s:s + n]) and len({w for w, _ in flat[s:s + n]}) == 2]
    if not starts:
        return None
    s = rng.choice(starts)
    return "\n".join(f"{names[who]}: {m}" for who, m in flat[s:s + n])


def summary_inputs(split: str, n: int, seed: int, notice_share: float = 0.3) -> list[str]:
    """n notification stacks of the split: message stacks of its conversations and, notice_share of them,
    notices (one, or two from different apps)."""
    rng = random.Random(seed)
    convs = list(conversations(split))
    rng.shuffle(convs)
    out: dict[str, None] = {}
    for conv in convs:
        if len(out) >= n:
            break
        if rng.random() < notice_share:
            out.setdefault("\n".join(notice(rng) for _ in range(rng.choice([1, 1, 2]))))
        stack = message_stack(conv, rng)
        if stack:
            out.setdefault(stack)
    return list(out)[:n]


NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")


def summary_faults(stack: str, summary: str) -> list[str]:
    """What makes a summary unfaithful or unusable for a notification (none: it passes): more than one
    sentence or more than 25 words, a number or a name that the stack does not hold, a copy of one of its
    messages (or, in a stack of several, a piece of one that says nothing of the others) or a message of its
    own ("Name: ..."), an assistant's talk, words the stack does not hold (more than one or a quarter, or one
    that is no word), three words said twice or a word said more often than the stack says it, a sender's
    voice (I, my, me), and who said what (speaker_faults)."""
    faults = []
    words = summary.split()
    if not 3 <= len(words) <= 25:
        faults.append(f"{len(words)} words")
    if re.search(r"[.!?](\s|$)", summary.rstrip(".!? ")) or "\n" in summary.strip():
        faults.append("more than one sentence")
    for number in NUMBER.findall(summary):
        if number not in stack:
            faults.append(f"number {number} not in the stack")
    known = words_lower()
    stems = {stem(w) for w in WORD.findall(stack)}
    for i, w in enumerate(WORD.findall(summary)):
        if not w[0].isupper() or w == "I" or w in stack or w[:3] in stack:
            continue
        if w.lower() not in known or (i > 0 and stem(w) not in stems):  # capitalised mid-sentence, a name: "Max"
            faults.append(f"name {w} not in the stack")
    norm = lambda t: " ".join(WORD.findall(t.lower()))  # noqa: E731
    lines = stack.splitlines()
    people = senders(stack)
    for line in lines:  # a message with or without its sender's name; a notice whole ("Card alert: ..." names no one)
        message = norm(line.split(": ", 1)[1] if people else line)
        if message and (norm(summary) in (message, norm(line)) or (len(lines) > 1 and norm(summary) in message)):
            faults.append("a copy of one message")
    labels = {line.split(": ", 1)[0] + ":" for line in lines if ": " in line}  # a sender's name, "Card alert"
    if (people and SENDER.match(summary.strip())) or summary.strip().startswith(tuple(labels)):
        faults.append("a message, not a summary (Name: ...)")
    if re.search(r"\b(assistant|as an ai|chatbot|i'm sorry|i can't|summary:)", summary, re.I):
        faults.append("assistant talk")
    content = [w for w in WORD.findall(summary) if w.lower() not in FRAME_WORDS and len(w) > 2]
    new = [w for w in content if stem(w) not in stems]
    if content and len(new) > max(1, len(content) // 4):  # a word or a quarter of them may be the summary's own
        faults.append(f"words not in the stack ({', '.join(new[:4])})")
    if garbled := [w for w in new if w.islower() and w not in known and w.replace("'", "") not in known]:
        faults.append(f"not a word ({', '.join(garbled[:3])})")
    said = [w.lower() for w in WORD.findall(summary)]
    threes = [tuple(map(stem, said[i:i + 3])) for i in range(len(said) - 2)
              if any(w not in FRAME_WORDS for w in said[i:i + 3])]  # "asks you to" twice is a frame, not a repeat
    if len(set(threes)) < len(threes):
        faults.append("says the same thing twice")
    if again := repeated(stack, summary, people):
        faults.append(f"says a word more often than the stack ({', '.join(again[:3])})")
    if re.search(r"\b(i|i'm|i've|i'll|i'd|im|ive|my|me|mine|myself)\b", summary, re.I):
        faults.append("speaks as a sender (I, my, me)")
    return faults + speaker_faults(people, summary)


def repeated(stack: str, summary: str, people) -> list[str]:
    """The summary's words (but a sender's name or a frame word) it says more often than the stack does, twice
    at least: filler ("Emma is ready and ready"), a word it made up said again ("a yacht, and a yacht")."""
    count = lambda t: Counter(stem(w) for w in WORD.findall(t)  # noqa: E731
                              if w.lower() not in FRAME_WORDS and len(w) > 2 and w not in people)
    have, said = count(stack), count(summary)
    return [w for w, n in said.items() if n > max(1, have[w])]


SENDER = re.compile(r"([A-Z][a-z]+): (.*)")
ASKING = re.compile(r"\b(ask|asks|asked|asking|wonders|wondering|wants to know)\b", re.I)
# a question: it ends in "?", or (as people type them) opens like one
QUESTION = re.compile(r".*\?\s*$|\s*(how|what|why|when|where|who|which|whose|(do|does|did|are|is|was|were|have|has|"
                      r"can|could|would|will|should|shall)\s+(you|u|we|they|he|she|it|i|there|that|this))\b", re.I | re.S)
ANSWER = re.compile(r"\b(yes|yeah|yep|yup|sure|no|nope|nah|not|never|nothing|none|\w+n't|dont|cant|wont|didnt|isnt)\b", re.I)
NEGATION = re.compile(r"\b(not|never|no|nope|nah|nothing|none|nobody|\w+n't|dont|cant|wont|didnt|isnt|wasnt)\b", re.I)


def senders(stack: str) -> dict[str, dict[str, str]]:
    """A message stack's senders, each with what they said as statements and as questions (sentences ending
    in "?"); empty for a notice (a stack is messages when it has two lines or more, each "Name: message")."""
    lines = [SENDER.fullmatch(line.strip()) for line in stack.splitlines()]
    if len(lines) < 2 or not all(lines):
        return {}
    out: dict[str, dict[str, str]] = {}
    for m in lines:
        said = out.setdefault(m.group(1), {"statements": "", "questions": "", "all": ""})
        said["all"] += " " + m.group(2)
        for sentence in re.findall(r"[^.!?]+[.!?]*", m.group(2)):
            said["questions" if QUESTION.match(sentence) else "statements"] += " " + sentence
    return out


def speaker_faults(people: dict[str, dict[str, str]], summary: str) -> list[str]:
    """Who said what, in a summary of a message stack: each clause whose subject is a sender ("Mia asks ...",
    ", so Jon says ...") must be that sender's. Its words come from the sender's own messages, from what
    another sender asked (the sender answering: then the sender's messages answer, yes or no), or from what
    another said when that one is named before them in the clause ("agrees with Mia that ..."); words of the
    sender's own question are said as a question ("asks"), not as a fact; "asks" needs a question of theirs
    ("asks you to" is a request), "says no", "not" and "yes" an answer or a negation of theirs, and only a
    sender says or asks anything."""
    if not people:
        return []
    stems = lambda t: {stem(w) for w in WORD.findall(t)}  # noqa: E731
    tokens = list(re.finditer(r"[A-Za-z]+(?:'[A-Za-z]+)*|[,;]", summary))
    # a clause starts at a sender (or another capitalised name that says or asks) at the start or after a joint
    starts = [i for i, t in enumerate(tokens) if t.group()[0].isupper() and t.group() != "I" and (
        i == 0 or tokens[i - 1].group() in {",", ";", "and", "so", "but", "while", "because", "then"})]
    faults = []
    for n, i in enumerate(starts):
        words = [t.group() for t in tokens[i:starts[n + 1] if n + 1 < len(starts) else None] if t.group() not in ",;"]
        who, clause = words[0], " ".join(words)
        if who not in people:
            if re.match(r"\w+ (says|said|asks|asked|replies|tells|agrees)\b", clause) and who.lower() not in words_lower():
                faults.append(f"{who} says something but sent nothing")
            continue
        own, others = people[who], {k: v for k, v in people.items() if k != who}
        if who in words[1:]:
            faults.append(f"{who} talks to themselves")
        asking = bool(ASKING.search(clause))
        if asking and not own["questions"] and re.search(r"\b(asks|asked|asking)\s+(if|whether|what|how|why|when|where|who)\b|\bwonder", clause, re.I):
            faults.append(f"{who} asks, but asked nothing")
        if re.search(r"\bsays? (no|yes)\b", clause) or NEGATION.search(clause):
            if not ANSWER.search(own["all"]):
                faults.append(f"{who} neither agrees nor denies")
        borrowed = False
        for k, w in enumerate(words[1:], 1):
            s = stem(w)
            if w.lower() in FRAME_WORDS or len(w) < 3 or w in people or s in stems(own["statements"]):
                continue
            if s in stems(own["questions"]):
                if not asking:
                    faults.append(f"{who}'s own question as a fact ({w})")
                continue
            named = [o for o in others if o in words[:k]]
            if any(s in stems(others[o]["all"]) for o in named):
                continue
            if any(s in stems(v["questions"]) for v in others.values()):
                borrowed = True
                continue
            if any(s in stems(v["all"]) for v in others.values()):
                faults.append(f"{who} did not say that ({w})")
        if borrowed and not ANSWER.search(own["all"]):
            faults.append(f"{who} neither agrees nor denies")
    return list(dict.fromkeys(faults))


def stem(word: str) -> str:
    """A word's first five letters once its ending is cut (-'s, -ing, -ed, -es, -s, then a final e):
    "talking", "talked" and "talks" are "talk"; "hoping" and "hopes" are "hope"'s; "plugged" is "plug"'s;
    "pass" keeps its s. Two words are the same word when their stems are."""
    w = word.lower().removesuffix("'s")
    cut = ""
    for end in ("ing", "ed", "es", "s"):
        if w.endswith(end) and len(w) - len(end) >= 3 and not w.endswith("ss"):
            if end == "es" and not re.search(r"(s|x|z|ch|sh)es$", w):
                continue  # "hopes": only its s
            w, cut = w[: -len(end)], end
            break
    if cut in ("ing", "ed") and len(w) > 3 and w[-1] == w[-2] and w[-1] not in "lsz":
        w = w[:-1]  # plugg(ed) -> plug; not "call(ing)" or "pass(ed)"
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    return w[:5]


# Words a summary may use that its stack need not hold: who says what to whom, and the joints of a sentence.
FRAME_WORDS = set("""a an the and but or so because if that this these those then than to of in on at for with from by about
as is are was were be been being has have had will would can could should may might do does did not no yes
you your you're yours he she they them their his her him it its it's he's she's they're we our us i me my
who what when where why how also still just both each other while after before up out there here some any all more most
ask asks asked asking tell tells telling told say says saying said talk talks talked talking want wants wanted wanting
think thinks thinking thought wonder wonders wondered wondering mention mentions mentioned mentioning add adds added
adding reply replies replied replying answer answers answered answering agree agrees agreed agreeing suggest suggests
suggested suggesting plan plans planned planning share shares shared sharing chat chats chatted chatting""".split())


@lru_cache(maxsize=1)
def words_lower() -> frozenset[str]:
    """The word list's words that are not only names (written in lower case there)."""
    return frozenset(w for w in words() if w.islower())


# --- per feature -------------------------------------------------------------------------------------------

def summarize_inputs(split: str, n: int, seed: int) -> list[tuple[str, str]]:
    """Notification stacks, with no target: the summaries are the base's own (train/adapter.distilled_summaries)."""
    return [(s, "") for s in summary_inputs(split, n, seed)]


PAIRS = {"proofread": proofread_pairs, "reply": reply_pairs, "summarize": summarize_inputs}  # (text, target) of a feature
HELD_OUT_SEED = 12345


def held_out(task: str, n: int) -> list[tuple[str, str]]:
    """The feature's held-out pairs (the eval split, a fixed seed): what the adapters' cards, the features' tau and
    the bench measure."""
    return PAIRS[task]("eval", n, seed=HELD_OUT_SEED)


def feature_texts(task: str, split: str, n: int, seed: int) -> list[str]:
    """n texts a user gives the feature (continue, the plain chat model: goes on with the reply set's messages)."""
    return [text for text, _ in PAIRS["reply" if task == "continue" else task](split, n, seed=seed)]


def held_out_texts(task: str, n: int) -> list[str]:
    return [text for text, _ in held_out("reply" if task == "continue" else task, n)]
