"""Writes each magic's flags, from its own help, into its reference page (docs/reference/),
between the `<!-- flags -->` markers: `python docs/flags.py`. tests/unit/test_docs.py fails
when a page's table differs from the magic's help, naming this command."""

from __future__ import annotations

import re
from pathlib import Path

PAGES = {"tpu_connect": "tpu_connect.md", "tpu_train": "tpu_train.md", "tpu_sync": "tpu_sync.md"}
START, END = "<!-- flags: written by docs/flags.py from the magic's help -->", "<!-- /flags -->"


def table(magic: str) -> str:
    """The magic's usage line and one row a flag: what `%magic?` says about it."""
    from tpu_magic.notebook.magics import TpuMagics

    parser = getattr(TpuMagics, magic).parser
    usage = " ".join(parser.format_usage().replace("::", "").split())
    rows = ["| flag | what it does |", "|---|---|"]
    for action in parser._actions:
        if "-h" in action.option_strings:
            continue
        name = ", ".join(action.option_strings) or action.dest.upper()
        if action.option_strings and action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
        # a table cell is Markdown: `<devices>` would be an HTML tag, and vanish
        text = " ".join((action.help or "").split()).replace("|", "\\|") \
            .replace("<", "&lt;").replace(">", "&gt;")
        rows.append(f"| `{name}` | {text} |")
    return "\n".join([START, "", f"`{usage}`", "", *rows, "", END])


def written(text: str, magic: str) -> str:
    """`text` with its flags table replaced (or put after the title where it has none)."""
    block = table(magic)
    if START in text:
        return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text,
                      flags=re.S)
    title, _, rest = text.partition("\n")
    return f"{title}\n\n{block}\n{rest}"


def main() -> None:
    root = Path(__file__).resolve().parent / "reference"
    for magic, page in PAGES.items():
        path = root / page
        path.write_text(written(path.read_text(), magic))


if __name__ == "__main__":
    main()
