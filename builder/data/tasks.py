"""The three tasks and their one prompt format, shared by training, Python decoding and the site.

A prompt is the task's prefix ids, the ids of the user's text, then the task's suffix ids. With
builder's own tokenizer (models/base) the prefix and suffix are marker tokens:

    continue:   <|continue|>{text}                 the model continues the text
    proofread:  <|proofread|>{text}<|fix|>         the model writes the corrected sentence, then <|endoftext|>
    summarize:  <|summarize|>{text}<|summary|>     the model writes a short summary (a title), then <|endoftext|>

Any other tokenizer (a user's own Llama-family checkpoint) has no such markers: the prompt is plain
text, after the model's beginning-of-sequence token when its config names one:

    continue:   [bos]{text}
    proofread:  [bos]Correct the spelling mistakes in this sentence.\nSentence: {text}\nCorrected:
    summarize:  [bos]Summarize this passage in a short title.\nPassage: {text}\nTitle:

A chat model (its checkpoint has a tokenizer_config.json with a `chat_template`, as SmolLM2-135M-Instruct)
is asked in its own template, rendered once with the task's instruction and the user's text as the user's
message; the rendered text before and after the user's text are the prefix and suffix. Chat models also
offer `reply` (a short smart reply to a message); `continue` is free chat (the text is the message):

    <|im_start|>system\n..<|im_end|>\n<|im_start|>user\n{instruction}{text}<|im_end|>\n<|im_start|>assistant\n

A tokenizer of builder's own that lacks a task's markers (the first base had no summarize task) does
not offer that task: `tok.tasks` holds the tasks a model can be asked for.

`load_tokenizer` works the format out once (`TaskTokenizer.tasks`); the export writes the same ids
into the manifest, so the page builds the same prompts.

Special tokens are never parsed out of the user's text, so a user who types "<|fix|>" gets those
characters, not the marker. Text is encoded as the code points it holds (control characters,
right-to-left marks and all); a lone surrogate (half of a UTF-16 pair, which no UTF-8 text can hold:
it comes from broken JSON escapes or undecodable command-line bytes) is replaced by U+FFFD, as the
page does with String.prototype.toWellFormed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import CheckpointError, PromptError
from ..models.config import load_config

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|continue|>", "<|proofread|>", "<|fix|>", "<|summarize|>", "<|summary|>"]

# task -> (marker before the text, separator after it): builder's own tokenizer
TASKS: dict[str, tuple[str, str | None]] = {
    "continue": ("<|continue|>", None),
    "proofread": ("<|proofread|>", "<|fix|>"),
    "summarize": ("<|summarize|>", "<|summary|>"),
}
# task -> (text before the user's text, text after it): any other tokenizer
TEXT_TASKS: dict[str, tuple[str, str]] = {
    "continue": ("", ""),
    "proofread": ("Correct the spelling mistakes in this sentence.\nSentence: ", "\nCorrected:"),
    "summarize": ("Summarize this passage in a short title.\nPassage: ", "\nTitle:"),
}

# task -> instruction before the user's text in the user's message: a chat model
CHAT_TASKS: dict[str, str] = {
    "continue": "",
    "proofread": "Correct the spelling mistakes in this sentence. Answer with the corrected sentence only.\n",
    "summarize": "Summarize this message in one sentence.\n",
    "reply": "Write a short, friendly reply to this message.\n",
}
ALL_TASKS = tuple(dict.fromkeys([*TASKS, *CHAT_TASKS]))  # every task some model offers
TEXT = "\x00TEXT\x00"  # stands for the user's text while a chat template is rendered


@dataclass(frozen=True)
class TaskTokenizer:
    """A checkpoint's tokenizer with the prompt format of each task (see above), worked out once at load.
    Everything else (encode, decode, token_to_id, ..) is the `tokenizers.Tokenizer`'s own."""
    tokenizer: Tokenizer
    tasks: dict[str, dict[str, list[int]]]  # task -> {"prefix": ids, "suffix": ids}
    chat: dict | None = None  # a chat model's template as turns (`chat_turns`): the page's LanguageModel

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def load_tokenizer(directory: str | Path) -> TaskTokenizer:
    """The checkpoint's tokenizer.json with its task prompt formats: the marker format when it has
    builder's special tokens, else the text format, after the beginning-of-sequence id of the
    checkpoint's config.json (if it has one)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path} is not a valid tokenizer.json: {e}") from None
    tok.encode_special_tokens = True  # "<|fix|>" typed by a user is text, not the marker
    template = chat_template(Path(directory))
    if template is not None:
        return TaskTokenizer(tok, chat_formats(tok, template), chat_turns(tok, template))
    bos = load_config(directory).get("bos_token_id") if (Path(directory) / "config.json").is_file() else None
    return TaskTokenizer(tok, prompt_formats(tok, bos[0] if isinstance(bos, list) else bos))


def chat_template(directory: Path) -> str | None:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid tokenizer_config.json: {e}") from None


def chat_formats(tok: Tokenizer, template: str) -> dict[str, dict[str, list[int]]]:
    """task -> {"prefix", "suffix"}: the chat template rendered around the user's text, in a sandbox as
    transformers renders it; the template's own special tokens ("<|im_start|>") are recognised in it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        render = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    except Exception as e:
        raise CheckpointError(f"the chat template does not parse: {e}") from None
    encode = lambda text: tok.encode_batch([text], add_special_tokens=False)[0].ids  # noqa: E731
    formats = {}
    for task, instruction in CHAT_TASKS.items():
        try:  # a template may raise (raise_exception), or use a variable it is not given ({{ tools.x }})
            text = render(messages=[{"role": "user", "content": instruction + TEXT}], add_generation_prompt=True)
        except Exception as e:
            raise CheckpointError(f"the chat template fails to render a user message ({type(e).__name__}: {e})") from None
        if TEXT not in text:
            raise CheckpointError("the chat template leaves out the user's message")
        before, _, after = text.partition(TEXT)
        tok.encode_special_tokens = False  # the template's markers are markers ..
        try:
            formats[task] = {"prefix": encode(before), "suffix": encode(after)}
        finally:
            tok.encode_special_tokens = True  # .. the user's text never holds one
    return formats


ROLES = ("system", "user", "assistant")


def chat_turns(tok: Tokenizer, template: str) -> dict:
    """The chat template cut into the ids a conversation is made of (the page's LanguageModel builds its
    prompts from these, `encode_chat` in Python): per role, the ids before and after a message's text
    ("roles"); the system turn the template adds to a conversation that opens without one
    ("default_system", SmolLM2's "You are a helpful AI assistant named SmolLM.."); and the ids that open
    the assistant's answer ("generation"). Each part is rendered alone (the template's markers
    recognised), as `chat_formats` renders a task's prompt around the user's text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    render = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render
    opening = [{"role": "system", "content": "S"}]

    def after(messages, generation=False):  # the text these messages add after the opening system turn
        head, text = render(messages=opening), render(messages=opening + messages, add_generation_prompt=generation)
        if not text.startswith(head):
            raise CheckpointError("the chat template does not render a conversation turn by turn")
        return text[len(head):]

    pieces = {"system": render(messages=[{"role": "system", "content": TEXT}]).partition(TEXT)[::2],
              **{role: after([{"role": role, "content": TEXT}]).partition(TEXT)[::2] for role in ROLES[1:]}}
    before_user = render(messages=[{"role": "user", "content": TEXT}]).partition(TEXT)[0]
    if not before_user.endswith(pieces["user"][0]):
        raise CheckpointError("the chat template does not render a conversation turn by turn")
    default_system = before_user[:len(before_user) - len(pieces["user"][0])]
    encode = lambda text: tok.encode_batch([text], add_special_tokens=False)[0].ids if text else []  # noqa: E731
    tok.encode_special_tokens = False  # the template's markers are markers ..
    try:
        return {"roles": {role: {"prefix": encode(before), "suffix": encode(after_)}
                          for role, (before, after_) in pieces.items()},
                "default_system": encode(default_system), "generation": encode(after([], generation=True))}
    finally:
        tok.encode_special_tokens = True  # .. a message's text never holds one


def encode_chat(tok: TaskTokenizer, messages: list[dict]) -> list[int]:
    """A conversation's prompt ids, as the page's LanguageModel builds them from `chat_turns`: the default
    system turn when the first message is not the system's, each message's turn, then the ids that open
    the assistant's answer."""
    if tok.chat is None:
        raise PromptError("this model has no chat template")
    ids = [] if messages and messages[0]["role"] == "system" else list(tok.chat["default_system"])
    for m in messages:
        turn = tok.chat["roles"][m["role"]]
        ids += turn["prefix"] + encode_text(tok, m["content"]) + turn["suffix"]
    return ids + tok.chat["generation"]


def prompt_formats(tok: Tokenizer, bos_id: int | None) -> dict[str, dict[str, list[int]]]:
    """task -> {"prefix": ids before the user's text, "suffix": ids after it}, for the tasks the model offers."""
    ids = tok.token_to_id
    if ids(EOS) is not None and ids(TASKS["continue"][0]) is not None:  # builder's own tokenizer
        return {task: {"prefix": [ids(marker)], "suffix": [ids(sep)] if sep else []}
                for task, (marker, sep) in TASKS.items() if ids(marker) is not None and (sep is None or ids(sep) is not None)}
    bos = [bos_id] if bos_id is not None else []
    return {task: {"prefix": bos + encode_text(tok, before), "suffix": encode_text(tok, after)}
            for task, (before, after) in TEXT_TASKS.items()}


def special_tokens(tok: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens (left out of decoded text), by content."""
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """text with every lone surrogate replaced by U+FFFD (a Python str holds pairs as one code point)."""
    return LONE_SURROGATE.sub("\ufffd", text)


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    """The ids of plain text: no special tokens are recognised in it."""
    return tok.encode(well_formed(text), add_special_tokens=False).ids if text else []


def encode_prompt(tok: Tokenizer, task: str, text: str) -> list[int]:
    if task not in ALL_TASKS:
        raise PromptError(f"unknown task {task!r}: choose one of {', '.join(ALL_TASKS)}")
    if task not in tok.tasks:
        raise PromptError(f"this model does not offer the task {task!r}: "
                          f"choose one of {', '.join(tok.tasks)}")
    if not text.strip():
        raise PromptError("the prompt is empty")
    fmt = tok.tasks[task]
    return fmt["prefix"] + encode_text(tok, text) + fmt["suffix"]


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)
