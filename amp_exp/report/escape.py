"""A value a run recorded, written into report.md and the W&B Report as text, never as markup.

Run names, models, precision labels, paths and error messages come from files in an output
directory, which anyone may have written (docs/faults.md): a model named ``<script>`` or
``[x](javascript:...)`` must reach the rendered page as those characters, and a ``|`` must not
split a table cell. Both pages take their text from the same functions (report/markdown.py), so
they show the same escaped text.
"""

from __future__ import annotations

import html
import re

# What opens markup inside a line: a backslash (which would undo the escapes after it), code
# spans, emphasis and strikethrough, links and images, table cells. An underscore between two
# letters or digits opens nothing (CommonMark), so tiny_cnn and bf16_true stay as they are.
_MARKUP = re.compile(r"[\\`*~\[\]|]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def md_text(value: object) -> str:
    """``value`` as one line of literal markdown text: markup characters backslash-escaped,
    HTML's ``& < >`` as entities, line breaks (which would start a heading or end a table row)
    as spaces."""
    text = " ".join(str(value).splitlines())
    return html.escape(_MARKUP.sub(lambda found: "\\" + found.group(), text), quote=False)
