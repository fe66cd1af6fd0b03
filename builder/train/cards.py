"""The model cards (README.md) the training commands write, rendered from templates/*.md.j2: the prose lives in
the templates, the numbers come from each model's train_log.json (and its config)."""
from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"


def environment():
    """jinja2 over templates/: an undefined name is an error, and a card keeps its final newline."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    return Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, keep_trailing_newline=True)


def render_card(out: Path, template: str, **context) -> None:
    """Writes out/README.md: the template rendered with context."""
    (Path(out) / "README.md").write_text(environment().get_template(template).render(**context))


def macro(template: str, name: str):
    """A macro of a template, as a function that returns its text (a piece of a card some code needs alone)."""
    return getattr(environment().get_template(template).module, name)
