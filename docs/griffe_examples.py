"""A griffe extension for the API reference: `Example:` followed by `>>>` lines is read as an `Examples:` section.

The docstrings follow keras-hub's habit, an `Example:` heading with the
session's lines at the heading's indentation. Griffe's Google parser wants
a section's lines indented under it, and would render the `>>>` lines as
Markdown quotes; here they become an `Examples:` section, rendered as a
Python session. Only the text handed to the parser changes, not the source.
"""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$")
# A line that ends the session early: the next section's heading.
_SECTION = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")


def examples_as_section(text):
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        heading = _HEADING.match(lines[i])
        if heading and i + 1 < len(lines) and lines[i + 1].startswith(heading.group(1) + ">>>"):
            out.append(heading.group(1) + "Examples:")
            i += 1
            while i < len(lines) and lines[i].strip() and not _SECTION.match(lines[i]):
                out.append("    " + lines[i])
                i += 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = examples_as_section(obj.docstring.value)
