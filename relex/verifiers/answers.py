"""Pull the part that is graded out of a model's completion.

Every verifier starts here: `completion_text` turns TRL's plain or conversational completion into a string,
`extract_final_answer` finds the final answer in it (the last `\\boxed{...}`, else the last number),
`committed_region` finds the short stretch of text the completion commits to as its answer (what the `math`
verifier hands to math-verify), and `last_fenced_block` finds the last Markdown code block of a language.
Only that part is ever handed to a checker, never the whole completion: a parser given the whole text finds
whatever expression the model restated ("To find 62 - 24, we ...") and grades that.

Everything here is linear in the completion's length: braces are matched in one pass with a stack, so a
completion of thousands of unclosed `\\boxed{` costs no more than any other text of its size.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata

from relex.errors import RelexError

_BOXED = re.compile(r"\\boxed\s*\{")
# A number is not part of a word or of a longer number; a minus sign counts only when it is not a binary
# operator ("11-18" ends with 18, "= -7" with -7). Thousands separators need exactly three digits per group.
_NUMBER = re.compile(r"(?<![\w./])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?(?!\.?[\w/])")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
# math-verify's own anchor: "final answer is", or up to 100 characters between the two ("final answer to (a) is")
_FINAL_ANSWER = re.compile(r"final answer.{0,100}?\s+is\b", re.IGNORECASE)
# What may stand between the boxes of one answer given in several: "\boxed{1}, \boxed{2} and \boxed{3}",
# "\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}", "y_1 = \boxed{..} and y_2 = \boxed{..}". A word
# outside \text{} other than and/or ("no wait") ends the group.
_BOX_SEPARATOR = re.compile(
    r"(?:\s|[,;$]|\\[()\[\]]|\\q?quad|\\[,;: ]|\band\b|\bor\b|\\text\{[^{}]{0,40}\}"
    r"|\b[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=)*"
)
REGION_CHARS = 1000  # the most text after an anchor (or at the end) that is handed to a parser


def completion_text(completion) -> str:
    """The text of a completion: a string, or the assistant messages of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        return "".join(_message_text(m) for m in completion if m.get("role", "assistant") == "assistant")
    raise RelexError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def _message_text(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    # multimodal content: a list of parts such as {"type": "text", "text": "..."}
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def ascii_digits(text: str) -> str:
    """The text with every decimal digit (full-width `１２`, Arabic-Indic `١٢`, ...) written as an ASCII digit."""
    return text if text.isascii() else text.translate(_digit_table())


@functools.cache
def _digit_table() -> dict[int, str]:
    """Every Unicode decimal digit that is not ASCII, to its ASCII digit (built on first use: 0.2 s)."""
    return {
        code: str(unicodedata.decimal(chr(code))) for code in range(128, sys.maxunicode + 1) if chr(code).isdecimal()
    }


def matching_braces(text: str) -> dict[int, int]:
    """For every `{` that is closed, the index of the `}` closing it; `\\{` and `\\}` are literal braces."""
    closing, stack, i = {}, [], 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            closing[stack.pop()] = i
        i += 1
    return closing


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """`(start, end)` of every closed `\\boxed{...}` in order: text[start:end] is the whole box."""
    closing = matching_braces(text)
    spans = []
    for match in _BOXED.finditer(text):
        end = closing.get(match.end() - 1)
        if end is not None:
            spans.append((match.start(), end + 1))
    return spans


def box_content(text: str, span: tuple[int, int]) -> str:
    start, end = span
    return text[text.index("{", start) + 1 : end - 1]


def boxed_contents(text: str) -> list[str]:
    """The contents of every closed `\\boxed{...}` in order, nested and escaped braces handled."""
    return [box_content(text, span) for span in boxed_spans(text)]


def find_closing_brace(text: str, start: int) -> int | None:
    """Index of the brace closing the group that opens just before `start`; None when it never closes."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ and \} are literal braces, not grouping
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return i
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number literal in the text, thousands separators removed and a Unicode minus made ASCII."""
    numbers = _NUMBER.findall(ascii_digits(text))
    return numbers[-1].replace(",", "").replace("\u2212", "-") if numbers else None


def extract_final_answer(text: str) -> str | None:
    """The final answer: the content of the last `\\boxed{}`, else the last number; None when there is none.

    A box is an explicit declaration, so when the text has one the last box decides, and an empty box is no
    answer (falling back to a number would grade an operand the model restated).
    """
    boxes = boxed_contents(text)
    if boxes:
        return boxes[-1].strip() or None
    return last_number(text)


def committed_region(text: str) -> str:
    """The stretch of the completion that states its answer, for a parser to extract the answer from.

    - "final answer ... is" after the last box (or with no box): the text from that phrase on;
    - else the last box, with the boxes just before it when only separators stand between them
      (`\\boxed{1}, \\boxed{2} and \\boxed{3}` is one answer; `\\boxed{5} no wait \\boxed{6}` answers 6);
    - else the end of the completion, where a trailing `$...$` or "the answer is 38" stands.

    At most `REGION_CHARS` characters of text around an anchor are returned, so the parser's regular
    expressions never see a long input.
    """
    text = ascii_digits(text)
    spans = _outermost(boxed_spans(text))
    anchor = _last_match(_FINAL_ANSWER, text)
    if anchor is not None and (not spans or anchor > spans[-1][1]):
        return text[anchor : anchor + REGION_CHARS]
    if spans:
        return text[_box_group_start(text, spans) : spans[-1][1]]
    return text[-REGION_CHARS:]


def _outermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The boxes that are not inside another box (`\\boxed{\\boxed{38}}` is one box)."""
    outer: list[tuple[int, int]] = []
    for start, end in spans:
        if not outer or start >= outer[-1][1]:
            outer.append((start, end))
    return outer


def _last_match(pattern: re.Pattern, text: str) -> int | None:
    start = None
    for match in pattern.finditer(text):
        start = match.start()
    return start


def _box_group_start(text: str, spans: list[tuple[int, int]]) -> int:
    """Start of the first box in the run of boxes, separated only by `_BOX_SEPARATOR`, that ends the list."""
    i = len(spans) - 1
    while i > 0 and _BOX_SEPARATOR.fullmatch(text, spans[i - 1][1], spans[i][0]):
        i -= 1
    return spans[i][0]


def last_fenced_block(text: str, languages: tuple[str, ...]) -> str | None:
    """The body of the last ``` block tagged with one of `languages` (lower case; "" is an untagged block)."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    return blocks[-1] if blocks else None
