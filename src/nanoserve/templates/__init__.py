"""Chat templates shipped with nanoserve and `--chat-template`: a file, the template's text, or a shipped
name; `renders_tools` says whether a template reads the `tools` it is given."""
from __future__ import annotations

import os
from importlib import resources

SHIPPED = {"chatml-tools": "chatml_tools.jinja"}


def resolve_chat_template(value: str) -> str:
    """The template text for `--chat-template VALUE`; ValueError for a missing file or a template that does
    not parse."""
    if value in SHIPPED:
        text = resources.files(__package__).joinpath(SHIPPED[value]).read_text()
    elif os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template must be a file, a Jinja template or one of {', '.join(SHIPPED)}; "
                         f"got {value!r}")
    renders_tools(text)  # a syntax error fails at start, not on the first request
    return text


def renders_tools(template: str) -> bool:
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not parse: {exc}") from None
