"""Pull the part that is graded out of a model's completion.

Every verifier starts here: `completion_text` turns TRL's plain or conversational completion into a string,
`extract_final_answer` finds the final answer in it (the last `\\boxed{...}`, else the last number), and
`last_fenced_block` finds the last Markdown code block of a language (```python, ```json).
Only the extracted answer is ever handed to a checker, never the whole completion: a parser given the whole
text finds whatever expression the model restated ("To find 62 - 24, we ...") and grades that.
"""

from __future__ import annotations

import re

from relex.errors import RelexError

_BOXED = re.compile(r"\\boxed\s*\{")
# A number is not part of a word or of a longer number; a minus sign counts only when it is not a binary
# operator ("11-18" ends with 18, "= -7" with -7). Thousands separators need exactly three digits per group.
_NUMBER = re.compile(r"(?<![\w./])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?(?!\.?[\w/])")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


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


def boxed_contents(text: str) -> list[str]:
    """The contents of every closed `\\boxed{...}` in order, nested and escaped braces handled."""
    contents = []
    for match in _BOXED.finditer(text):
        end = find_closing_brace(text, match.end())
        if end is not None:
            contents.append(text[match.end() : end])
    return contents


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
    numbers = _NUMBER.findall(text)
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


def last_fenced_block(text: str, languages: tuple[str, ...]) -> str | None:
    """The body of the last ``` block tagged with one of `languages` (lower case; "" is an untagged block)."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    return blocks[-1] if blocks else None
