"""The one exception type that relex raises for bad input.

The CLI turns a `RelexError` into a single line on stderr and a non-zero exit, without a traceback.
Anything else that escapes is a bug in relex and keeps its traceback.
"""


class RelexError(Exception):
    """Bad input or state that the user can fix; the message names the file, tensor or step at fault."""
