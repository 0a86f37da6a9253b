"""The help formatter of every command: prose paragraphs are wrapped, indented blocks kept as written."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Wraps paragraphs of plain prose; keeps paragraphs with indented lines (examples) verbatim."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap  # only to print a help: not at every start-up

        paragraphs = text.split("\n\n")
        out = []
        for para in paragraphs:
            lines = para.splitlines()
            if any(line.startswith(" ") for line in lines[1:]) or para.startswith(" "):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(lines), width, initial_indent=indent, subsequent_indent=indent
                    )
                )
        return "\n\n".join(out)
